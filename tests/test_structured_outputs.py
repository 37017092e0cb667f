"""Structured outputs: every output follows its grammar, and constraining one request changes
nothing for the others, nor under preemption, chunked prefill, prefix caching and n > 1."""
import json
import os
import pickle
import re

import pytest

from flagserve import LLM, SamplingParams, StructuredOutputsParams

# Both are dependencies of the project; the lent GPU machine's image has them only where its
# call carried benchmarks/gpu_wheels.sh's wheels.
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"], "additionalProperties": False}
PROMPTS = ["The weather today is sunny and the", "We cook rice with beans and",
           "Count to 42 and write code on old computers before the rain comes back."]


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


def constrained(temperature: float = 0.0, n: int = 1, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, n=n, seed=7 if temperature else None, max_tokens=80,
                          structured_outputs=StructuredOutputsParams(**kind))


def texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def test_json_schema_outputs_validate(llm):
    # Random weights: left alone the tiny model writes gibberish; the grammar makes it JSON.
    outs = llm.generate(PROMPTS, [constrained(json=SCHEMA), constrained(1.0, n=3, json=json.dumps(SCHEMA)),
                                  constrained(0.8, json_object=True)], use_tqdm=False)
    for out in outs[:2]:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs[1].outputs}) > 1  # three samples, each its own matcher
    # Any object: random weights rarely close it within 80 tokens, but it is one from the start.
    obj = outs[2].outputs[0]
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_choice_regex_and_grammar(llm):
    choices = ["yes", "no", "perhaps not"]
    outs = llm.generate(PROMPTS * 2, [constrained(1.0, n=4, choice=choices),
                                      constrained(regex=r"[a-c]{2,5}-\d{3}"),
                                      constrained(0.9, grammar='root ::= "(" d d? d? ")"\nd ::= [0-9]')] * 2,
                        use_tqdm=False)
    assert all(c.text in choices for c in outs[0].outputs)
    assert re.fullmatch(r"[a-c]{2,5}-\d{3}", outs[1].outputs[0].text)
    assert re.fullmatch(r"\(\d{1,3}\)", outs[2].outputs[0].text)
    assert texts(outs[:3]) == texts(outs[3:])  # seeded: the same again, one compiled grammar


def test_unconstrained_neighbours_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [constrained(json=SCHEMA)] * 3, use_tqdm=False)
    assert texts(mixed[:3]) == texts(alone)
    assert texts(mixed[3:]) == texts(llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False))


def test_requests_awaiting_their_grammar_count_as_waiting(llm):
    engine = llm.llm_engine
    engine.add_request("held", PROMPTS[0], constrained(json=SCHEMA, n=2, temperature=1.0))
    assert engine.get_stats().num_waiting == 2  # held until compiled, not in the scheduler yet
    engine.abort("held")
    assert engine.get_stats().num_waiting == 0


def test_preemption_and_chunking_keep_outputs(llama_path, llm):
    params = [constrained(json=SCHEMA), constrained(1.0, n=3, regex=r"[a-z ]{5,60}\."),
              constrained(0.7, n=2, json=SCHEMA)] * 2
    long = [p * 3 for p in PROMPTS] * 2  # several blocks each, shared prefixes across requests
    reference = texts(llm.generate(long, params, use_tqdm=False))
    tight = LLM(llama_path, dtype="float32", num_kv_blocks=14, max_model_len=224,
                max_num_batched_tokens=24, max_num_seqs=8)
    assert texts(tight.generate(long, params, use_tqdm=False)) == reference
    assert tight.llm_engine.get_stats().num_preemptions > 0


def test_matcher_replays_the_tokens_when_out_of_step(llm):
    # A matcher that counts more tokens than its sequence holds is reset and replayed: the
    # output is the one of an undisturbed run.
    params = constrained(regex=r"[a-z]{3,30}")
    reference = texts(llm.generate(PROMPTS[:1], params, use_tqdm=False))
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[0], params)
    while not engine.structured.matchers:
        engine.step()  # the grammar compiles off the loop; its first step samples
    seq = engine.requests["r"].seqs[0]
    engine.step()
    engine.structured.matchers[seq.seq_id].num_seen += 5
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [[o.outputs[0].text for o in outputs if o.finished]] == reference


@pytest.mark.parametrize("kind, value, message", [
    ("json", '{"type": "wat"}', "not a valid json"),
    ("json", "{not json", "invalid JSON"),
    ("regex", "a(b", "not a valid regex"),
    ("grammar", 'root ::= "a" |', "not a valid grammar"),
    ("choice", [], "non-empty list"),
    # a language with no text in it: every token would be outside the grammar (200, "abort")
    ("regex", r"[^\s\S]", "matches no text at all"),
    ("grammar", "root ::= [^\\x00-\\U0010FFFF]", "matches no text at all"),
    # what xgrammar would answer with output that does not validate: refused
    ("json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ("json", {"type": "array", "contains": {"const": 1}}, "'contains'"),
    ("json", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ("json", {"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "'not'"),
    ("json", {"type": "string", "pattern": "[a-z]+", "maxLength": 5}, "'pattern' or 'format'"),
    ("json", {"$defs": {"A": {"type": "string"}}, "$ref": "#/$defs/A", "maxLength": 3}, "beside"),
    # nested past what the parser takes in time (a 1.3 KB body hung the served engine)
    ("json", {"type": "integer", "default": json.loads("[" * 100 + "]" * 100)}, "deeper than 64"),
])
def test_invalid_constraints_name_the_field(kind, value, message):
    with pytest.raises(ValueError, match=f"structured_outputs.{kind} .*{message}"):
        StructuredOutputsParams(**{kind: value})
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_keywords_as_property_names_and_metadata_beside_refs_are_fine():
    schema = {"type": "object", "$defs": {"Loc": {"type": "string"}},
              "properties": {"not": {"type": "integer"}, "if": {"type": "boolean"},
                             "where": {"$ref": "#/$defs/Loc", "description": "a city"}},
              "required": ["not", "if", "where"]}
    StructuredOutputsParams(json=schema)
    # enforced by xgrammar (its grammar names the pattern): not refused
    StructuredOutputsParams(json={"type": "object", "patternProperties": {"^x": {"type": "integer"}}})


def test_params_pickle_for_the_engine_process():
    params = constrained(json=SCHEMA)
    again = pickle.loads(pickle.dumps(params))
    again.validate()
    assert again.structured_outputs == params.structured_outputs


def test_schema_key_order_is_kept():
    # The grammar writes properties in the schema's order: the cache key must not sort them.
    assert StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}}).spec() \
        == '{"type": "object", "properties": {"b": {}, "a": {}}}'


@pytest.mark.parametrize("vocab", [1000, 1536])
@pytest.mark.parametrize("impl", ["torch", "native"])
def test_token_bitmask_matches_xgrammar(vocab, impl):
    # Ours against xgrammar's own kernel, on a vocabulary that ends mid-word, with rows that
    # allow nothing and everything, and logits already -inf (bans).
    import torch
    import xgrammar as xgr

    from kernels import cpu_native
    from kernels.sampling import apply_token_bitmask_torch
    if impl == "native" and not cpu_native.available():
        pytest.skip("the native CPU kernels do not build here")
    apply = apply_token_bitmask_torch if impl == "torch" else cpu_native.apply_token_bitmask_cpu
    gen = torch.Generator().manual_seed(0)
    mask = xgr.allocate_token_bitmask(4, vocab)
    mask.copy_(torch.randint(-2**31, 2**31 - 1, mask.shape, generator=gen, dtype=torch.int32))
    mask[1], mask[2] = 0, -1
    logits = torch.randn(4, vocab, generator=gen)
    logits[3, :7] = float("-inf")
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask)
    assert torch.equal(apply(logits, mask), expected)


def test_step_input_sends_the_filled_mask_to_shards():
    # The mask fills beside the forward; a shard worker (another process) gets the tensor.
    # (Any job with result() will do: a Future here.)
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from flagserve.engine.step_input import StepInput
    mask = torch.tensor([[5, -1]], dtype=torch.int32)
    with ThreadPoolExecutor(1) as pool:
        step = StepInput([1], [1], [3], [[0]], [7], [0], [2], None,
                         token_bitmask=pool.submit(lambda: mask))
        again = pickle.loads(pickle.dumps(step))
    assert torch.equal(again.token_bitmask, mask) and torch.equal(step.grammar_bitmask(), mask)


X86, CHECKED = (pytest.param(False, id="x86"), pytest.param(True, id="checked-mask"))
# The grammar process's life does not depend on how masks are read: one mode is enough there.
ONE_MODE = pytest.mark.parametrize("grammars", [X86], indirect=True)


@pytest.fixture(params=[X86, CHECKED])
def grammars(llama_path, request, monkeypatch):
    """StructuredOutputs alone, its grammar process stopped after the test however it ends;
    also with the mask checksums a weakly ordered CPU gets (worker.weakly_ordered)."""
    from flagserve.engine.structured_outputs import matchers
    from flagserve.engine.structured_outputs.matchers import StructuredOutputs
    from flagserve.models.tokenizer import load_tokenizer
    monkeypatch.setattr(matchers, "weakly_ordered", lambda: request.param)
    tok = load_tokenizer(llama_path)
    so = StructuredOutputs(llama_path, len(tok), [tok.eos_token_id], max_rows=4)
    yield so, tok
    so.shutdown()


def _ready(so, request_id: str, seqs: list) -> None:
    import time
    so.hold(request_id, seqs)
    while not so.release()[0]:
        time.sleep(0.01)


def test_matchers_follow_tokens_queued_preempted_and_rejected(grammars):
    # A token is queued at once and accepted by the next mask's job; a stop token ends the
    # grammar at once; a token outside the grammar (a bug) is reported by the next advance.
    from flagserve.engine.sequence import Sequence
    so, tok = grammars
    eos = tok.eos_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    seqs = [Sequence("r", i, [1, 2], 2, constrained(regex="(ab)+"), 0.0) for i in range(3)]
    _ready(so, "r", seqs)

    def step(tokens: list[int]) -> list:
        mask = so.bitmask(seqs).result()
        allowed = [bool(mask[i, t // 32] >> (t % 32) & 1) for i, t in enumerate(tokens)]
        for seq, t in zip(seqs, tokens):
            seq.token_ids.append(t)
        return allowed, so.advance_all(seqs)

    assert step([a, a, a]) == ([True] * 3, ["ok"] * 3)
    allowed, status = step([b, a, b])
    assert allowed == [True, False, True] and status == ["ok"] * 3
    allowed, status = step([eos, b, a])  # the second matcher stayed after its first "a"
    assert allowed == [True, True, True] and status == ["terminated", "rejected", "ok"]
    seqs[2].token_ids[2:] = [a]  # preempted and recomputed with fewer tokens: replayed
    assert so.advance_all([seqs[2]]) == ["ok"] and so.matchers[seqs[2].seq_id].num_seen == 1
    mask = so.bitmask(seqs[2:]).result()  # after "a" only "b"
    assert [t for t in (a, b, eos) if mask[0, t // 32] >> (t % 32) & 1] == [b]


def test_next_masks_are_filled_once_the_tokens_are_known(grammars):
    # advance_all sends the job that fills the next masks, so the next step sends none of its
    # own; a row it did not cover (a new sequence) gets the step's own job, and the step's mask
    # is composed of both, all ones for an unconstrained row.
    from flagserve.engine.sequence import Sequence
    so, tok = grammars
    a, b = tok.convert_tokens_to_ids(["a", "b"])

    def allowed(mask, row: int) -> list[int]:
        return [t for t in (a, b) if mask[row, t // 32] >> (t % 32) & 1]

    first = Sequence("r1", 0, [1, 2], 2, constrained(regex="(ab)+"), 0.0)
    _ready(so, "r1", [first])
    assert allowed(so.bitmask([first]).result(), 0) == [a]
    first.token_ids.append(a)
    assert so.advance_all([first]) == ["ok"]
    sent = so.process.last_job
    job = so.bitmask([first])
    assert so.process.last_job == sent and [part[0] for part in job.parts] == [sent]
    assert allowed(job.result(), 0) == [b]
    second = Sequence("r2", 1, [1, 2], 2, constrained(regex="(ab)+"), 0.0)
    _ready(so, "r2", [second])
    free = Sequence("r3", 2, [1, 2], 2, SamplingParams(max_tokens=4), 0.0)
    job = so.bitmask([second, free, first])
    assert [part[0] for part in job.parts] == [sent, sent + 1]
    mask = job.result()
    assert allowed(mask, 0) == [a] and bool((mask[1] == -1).all()) and allowed(mask, 2) == [b]


@ONE_MODE
def test_jobs_over_the_pipe_and_the_shared_memory_keep_their_order(grammars, monkeypatch):
    # A job too large for its area (a long replay) goes over the pipe: the grammar process
    # takes it, and the shared-memory job after it, in their order.
    from flagserve.engine.sequence import Sequence
    from flagserve.engine.structured_outputs import process
    so, tok = grammars
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    seqs = [Sequence("r", 0, [1, 2], 2, constrained(regex="(ab)+"), 0.0)]
    _ready(so, "r", seqs)
    for token, shared in ((a, False), (b, True), (a, False), (b, True)):
        monkeypatch.setattr(process, "JOB_BYTES", (1 << 20) if shared else 0)
        mask = so.bitmask(seqs).result()
        assert [t for t in (a, b) if mask[0, t // 32] >> (t % 32) & 1] == [token]
        seqs[0].token_ids.append(token)
        assert so.advance_all(seqs) == ["ok"]


@ONE_MODE
def test_grammar_process_death_is_an_error_not_a_hang(grammars):
    # Killed under the engine: the held request fails, the next mask raises, both saying so;
    # shutdown() after it still returns.
    from flagserve.engine.sequence import Sequence
    from flagserve.engine.structured_outputs.process import GrammarProcessError
    so, _ = grammars
    first = [Sequence("r1", 0, [1, 2], 2, constrained(regex="[a-z]+"), 0.0)]
    _ready(so, "r1", first)
    so.process.proc.kill()
    so.process.proc.wait()
    so.hold("r2", [Sequence("r2", 1, [1, 2], 2, constrained(regex="[0-9]+"), 0.0)])
    ready, failed = so.release()
    assert ready == [] and [r for r, _ in failed] == ["r2"] and "grammar process" in failed[0][1]
    with pytest.raises(GrammarProcessError, match="grammar process"):
        so.bitmask(first).result()


@pytest.mark.parametrize("grammars", [CHECKED], indirect=True)
def test_a_mask_that_never_matches_its_checksum_is_an_error(grammars, monkeypatch):
    from flagserve.engine.sequence import Sequence
    from flagserve.engine.structured_outputs import process, worker
    so, _ = grammars
    seqs = [Sequence("r", 0, [1, 2], 2, constrained(regex="[a-z]+"), 0.0)]
    _ready(so, "r", seqs)
    job = so.bitmask(seqs)
    job.result()  # filled, and its checksum matched
    assert so.process.check_mask
    (number, _, _), = job.parts
    # An older job's checksum of these very rows (what a stale read of both would see) does
    # not pass for this job: the checksum is seeded with the job's number.
    stale = worker.mask_crc(so.process.mask, number - worker.AREAS, 1)
    worker.write_slot(so.process.slots, worker.MASK_CRC[number % worker.AREAS], stale)
    monkeypatch.setattr(process, "UNREADABLE_S", 0.01)
    with pytest.raises(process.GrammarProcessError, match="mask of job .* stayed unreadable"):
        job.result()


@ONE_MODE
def test_shutdown_stops_the_grammar_process(grammars):
    from flagserve.engine.sequence import Sequence
    so, _ = grammars
    _ready(so, "r", [Sequence("r", 0, [1, 2], 2, constrained(regex="[a-z]+"), 0.0)])
    proc = so.process.proc
    so.shutdown()
    assert proc.poll() is not None


def test_grammar_process_ends_with_its_engine(llama_path):
    # An engine process that dies without shutdown() (killed, crashed) leaves no grammar
    # process behind: its end of the pipe closes and the grammar process exits.
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from flagserve.models.tokenizer import load_tokenizer
    tok = load_tokenizer(llama_path)
    script = f"""
import os, time
from flagserve.engine.sequence import Sequence
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.structured_outputs.matchers import StructuredOutputs
from flagserve.engine.structured_outputs.params import StructuredOutputsParams
so = StructuredOutputs({llama_path!r}, {len(tok)}, [{tok.eos_token_id}], max_rows=4)
params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
so.hold("r", [Sequence("r", 0, [1, 2], 2, params, 0.0)])
while not so.release()[0]:
    time.sleep(0.01)
print(so.process.proc.pid, flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[-1])

    def running() -> bool:
        try:
            return " Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:2]
        except OSError:
            return False
    try:
        deadline = time.monotonic() + 10
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running()
    finally:
        if running():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_header_slots_are_never_read_torn():
    # The engine and the grammar process poll each other's counters in the shared header: a
    # counter read half-written (a job number crossing a multiple of 256 read as 0) made the
    # grammar process take a job twice and reject its tokens. Here one process counts across
    # such boundaries while this one reads: the value must never go back.
    import mmap
    import time

    from flagserve.engine.structured_outputs.worker import (
        HEADER,
        SUBMITTED,
        header_slots,
        read_slot,
        write_slot,
    )
    mm = mmap.mmap(-1, HEADER)
    slots = header_slots(mm)
    count = 400_000
    pid = os.fork()
    if pid == 0:  # the writer: plain Python only, then out without pytest's teardown
        for value in range(1, count + 1):
            write_slot(slots, SUBMITTED, value)
        os._exit(0)
    last, backwards = 0, 0
    deadline = time.monotonic() + 60  # a writer that died early fails the test, never hangs it
    try:
        while last < count and time.monotonic() < deadline:
            value = read_slot(slots, SUBMITTED)
            backwards += value < last
            last = max(last, value)
    finally:
        os.waitpid(pid, 0)
    assert backwards == 0 and last == count, (backwards, last)


def test_a_job_is_taken_only_once_all_its_bytes_are_there(monkeypatch):
    # On a weakly ordered CPU the engine's job number can be seen before the job's bytes: the
    # grammar process must not take stale or torn bytes for the job, and must not wait for
    # ever either.
    import mmap
    import time
    import types
    import zlib

    from flagserve.engine.structured_outputs import worker as w

    mm = mmap.mmap(-1, w.HEADER + w.AREAS * w.JOB_BYTES)
    slots = w.header_slots(mm)
    reader = types.SimpleNamespace(seen=0, unreadable_since=None, mm=mm, slots=slots)

    def take() -> w.Step | None:  # the Worker's method, without xgrammar and a tokenizer
        return w.Worker.take_job(reader)

    def write(step: w.Step, number: int, crc_of: bytes | None = None) -> bytes:
        data = pickle.dumps(step)
        start, area = w.job_offset(number), number % w.AREAS
        mm[start:start + len(data)] = data
        w.write_slot(slots, w.JOB_LEN[area], len(data))
        w.write_slot(slots, w.JOB_CRC[area], zlib.crc32(data if crc_of is None else crc_of))
        w.write_slot(slots, w.SUBMITTED, number)
        return data

    first = w.Step(1, [], ([], []), [7])
    assert take() is None  # nothing submitted
    write(first, 1)
    assert take() == first and reader.seen == 1
    assert take() is None  # taken once
    second = w.Step(2, [("forget", 7)], ([], []), [])
    third = w.Step(3, [], ([], []), [])
    write(third, 2)  # number 2 visible, its area holding another job's bytes
    assert take() is None and reader.seen == 1
    new = pickle.dumps(second)
    half = len(new) // 2  # half new, half what was there, with the new one's length and crc
    start = w.job_offset(2)
    mm[start:start + half] = new[:half]
    w.write_slot(slots, w.JOB_LEN[0], len(new))
    w.write_slot(slots, w.JOB_CRC[0], zlib.crc32(new))
    assert take() is None
    write(second, 2)  # all there now
    assert take() == second and reader.seen == 2
    write(first, 3)  # job 3 never becomes readable
    assert take() is None
    monkeypatch.setattr(w, "UNREADABLE_S", 0.0)
    time.sleep(0.01)
    with pytest.raises(RuntimeError, match="job 3 in the shared memory stayed unreadable: it holds job 1"):
        take()
