"""Prefill/decode disaggregation in one process: a prefill engine hands each request off after
its first token, a decode engine receives its KV and finishes it, token-identical to one
engine doing both; blocks are freed on both sides, also on abort and failure."""
import threading
import time

import pytest

from flagserve import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams
from flagserve.engine.kv_transfer.inproc import inprocess_pair

SYSTEM = ("You are a careful assistant who answers questions about cooking, weather and old "
          "computers in short plain sentences, and always counts to ten before answering. ")
PROMPTS = ["How do I cook rice?", "Will it rain today? " * 4, "What is a floppy disk?", "Name a spice."]
BLOCKS = 64


def engine(path: str, transport=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", BLOCKS)
    kw.setdefault("max_model_len", kw["num_kv_blocks"] * 16)  # what the cache holds at most
    # Eager: the transfer does not care how decode steps run, and engines start faster.
    return LLMEngine(EngineArgs(model=path, dtype="float32", enforce_eager=True, **kw),
                     kv_transport=transport)


def requests() -> list[tuple[str, str, SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    return [
        ("greedy", SYSTEM + PROMPTS[0], greedy),
        ("long", SYSTEM + PROMPTS[1], greedy),  # several blocks, chunked on the prefill side
        ("seeded", SYSTEM + PROMPTS[2], SamplingParams(temperature=1.0, top_p=0.9, seed=11,
                                                       max_tokens=16, ignore_eos=True)),
        ("n3", SYSTEM + PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                   ignore_eos=True)),
        ("one", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1)),  # ends on the prefill side
    ]


def finals(outs, into: dict) -> None:
    into.update({o.request_id: o for o in outs if o.finished})


def run_aggregated(eng: LLMEngine, reqs) -> dict:
    for r in reqs:
        eng.add_request(*r)
    done: dict = {}
    while eng.has_unfinished():
        finals(eng.step(), done)
    return done


def run_disaggregated(prefill: LLMEngine, decode: LLMEngine, reqs, on_loop=None) -> dict:
    for r in reqs:
        prefill.add_prefill_request(*r)
    done: dict = {}
    deadline = time.monotonic() + 120
    while prefill.has_unfinished() or decode.has_unfinished():
        assert time.monotonic() < deadline, "disaggregated run did not finish"
        finals(prefill.step(), done)
        for handoff in prefill.take_handoffs():
            decode.import_request(handoff)
        finals(decode.step(), done)
        if on_loop is not None:
            on_loop()
    return done


def completions(out) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def reference(llama_path) -> dict:
    return run_aggregated(engine(llama_path), requests())


def assert_all_free(*engines: LLMEngine) -> None:
    for eng in engines:
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert not eng.has_unfinished()


def decode_only_steps(eng: LLMEngine) -> list[bool]:
    """Records whether each step the engine runs has one token per sequence."""
    seen, execute = [], eng.executor.execute

    def spy(step):
        seen.append(step.num_tokens == len(step.seq_ids))
        return execute(step)

    eng.executor.execute = spy
    return seen


def test_disaggregated_matches_aggregated(llama_path, reference):
    p, d = inprocess_pair()
    prefill = engine(llama_path, p, max_num_batched_tokens=32)  # prompts run in chunks
    decode = engine(llama_path, d)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run_disaggregated(prefill, decode, [("warm", SYSTEM, warm)])  # the shared prefix, cached
    steps = decode_only_steps(decode)
    got = run_disaggregated(prefill, decode, requests())
    assert set(got) == set(reference)
    for rid, ref in reference.items():
        assert completions(got[rid]) == completions(ref), rid
        assert got[rid].error is None
    for a, b in zip(got["greedy"].outputs[0].logprobs, reference["greedy"].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert len({tuple(c.token_ids) for c in got["n3"].outputs}) == 3  # n really sampled
    assert all(got[r].num_cached_tokens >= 32 for r in ("greedy", "long", "seeded", "n3"))
    assert steps and all(steps)  # the decode engine never recomputed a prompt: the KV came over
    assert p.stats.requests_sent == d.stats.requests_received == 5  # "one" needed no transfer
    assert_all_free(prefill, decode)


def test_stop_strings_on_the_decode_side(llama_path, reference):
    text = reference["greedy"].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    req = [("stop", SYSTEM + PROMPTS[0], params)]
    want = run_aggregated(engine(llama_path), req)["stop"]
    assert want.outputs[0].finish_reason == "stop" and len(want.outputs[0].token_ids) > 1
    p, d = inprocess_pair()
    got = run_disaggregated(engine(llama_path, p), engine(llama_path, d), req)["stop"]
    assert completions(got) == completions(want)


def test_decode_admits_only_when_blocks_fit(llama_path, reference):
    p, d = inprocess_pair()
    prefill = engine(llama_path, p)
    reqs = [r for r in requests() if r[0] in ("greedy", "seeded")]
    need = [-(-len(prefill.tokenizer.encode(r[1])) // 16) for r in reqs]
    assert min(need) >= 2
    # Room for either request's prompt and decodes, never for both prompts at once.
    decode = engine(llama_path, d, num_kv_blocks=max(need) + 1)
    waited = []

    def on_loop():
        waiting = len(decode.kv_imports.waiting)
        waited.append(waiting)
        if waiting:  # counted as waiting (metrics, the router's load, autoscaling)
            assert decode.get_stats().num_waiting >= waiting

    got = run_disaggregated(prefill, decode, reqs, on_loop=on_loop)
    assert 1 in waited  # the second request waited for blocks ...
    for rid, _, _ in reqs:  # ... and both came out right
        assert completions(got[rid]) == completions(reference[rid])
    assert_all_free(prefill, decode)


def gated(endpoint, blocks_of: list[int]) -> tuple[threading.Event, threading.Event]:
    """Holds the copy of these blocks until released: a transfer under way."""
    entered, release, gather = threading.Event(), threading.Event(), endpoint.caches.gather

    def slow(blocks):
        if list(blocks) == blocks_of:
            entered.set()
            assert release.wait(30)
        return gather(blocks)

    endpoint.caches.gather = slow
    return entered, release


def hand_off(prefill: LLMEngine, decode: LLMEngine, reqs) -> None:
    for r in reqs:
        prefill.add_prefill_request(*r)
    while len(prefill.kv_exports.exporting) < len(reqs):
        prefill.step()
    for h in prefill.take_handoffs():
        decode.import_request(h)


def finish(prefill: LLMEngine, decode: LLMEngine) -> dict:
    return run_disaggregated(prefill, decode, [])


def test_abort_mid_transfer_frees_blocks_on_both_sides(llama_path, reference):
    p, d = inprocess_pair()
    prefill, decode = engine(llama_path, p), engine(llama_path, d)
    reqs = [r for r in requests() if r[0] in ("greedy", "seeded")]
    hand_off(prefill, decode, reqs)
    tables = {r: s[0].block_table for r, s in prefill.kv_exports.exporting.items()}
    entered, release = gated(p, tables["greedy"])
    decode.step()  # both fit: both fetches start, the first one stalls mid-copy
    assert entered.wait(30)
    received = {r: i.blocks for r, i in decode.kv_imports.fetching.items()}
    prefill.abort("greedy")
    decode.abort("greedy")
    # Neither side may reuse blocks the copy is reading or writing: all are still held.
    assert prefill.block_manager.num_free_blocks == BLOCKS - len(set(tables["greedy"] + tables["seeded"]))
    assert decode.block_manager.num_free_blocks == BLOCKS - len(received["greedy"] + received["seeded"])
    release.set()
    got = finish(prefill, decode)
    assert "greedy" not in got
    assert completions(got["seeded"]) == completions(reference["seeded"])
    assert_all_free(prefill, decode)


def test_failed_transfer_fails_that_request_only(llama_path, reference):
    p, d = inprocess_pair()
    prefill, decode = engine(llama_path, p), engine(llama_path, d)
    reqs = [r for r in requests() if r[0] in ("greedy", "seeded")]
    hand_off(prefill, decode, reqs)
    prefill.abort("greedy")  # its KV is gone before the decode engine asks for it
    held = len(prefill.kv_exports.exporting["seeded"][0].block_table)
    assert prefill.block_manager.num_free_blocks == BLOCKS - held  # freed at once
    got = finish(prefill, decode)
    assert got["greedy"].outputs[0].finish_reason == "abort"
    assert "no KV is offered for request 'greedy'" in got["greedy"].error
    assert completions(got["seeded"]) == completions(reference["seeded"])
    assert got["seeded"].error is None and d.stats.failures == 1
    assert_all_free(prefill, decode)


def test_unfetched_offer_expires_and_frees(llama_path):
    p, _ = inprocess_pair(offer_timeout_s=0.2)
    prefill = engine(llama_path, p)
    prefill.add_prefill_request("lost", SYSTEM, SamplingParams(max_tokens=4, ignore_eos=True))
    deadline = time.monotonic() + 30
    while prefill.has_unfinished():  # handed off to a decode engine that never fetches
        assert prefill.step() == [] and time.monotonic() < deadline
    assert [h.request_id for h in prefill.take_handoffs()] == ["lost"]
    assert_all_free(prefill)
    assert p.stats.failures == 1


def test_bad_handoffs_are_rejected(llama_path):
    p, d = inprocess_pair()
    prefill, decode = engine(llama_path, p), engine(llama_path, d, block_size=32)
    prefill.add_prefill_request("r", SYSTEM, SamplingParams(max_tokens=4))
    while not prefill.kv_exports.exporting:
        prefill.step()
    with pytest.raises(ValueError, match="KV layout"):
        decode.import_request(prefill.take_handoffs()[0])
    with pytest.raises(ValueError, match="needs a KV transport"):
        engine(llama_path).add_prefill_request("x", SYSTEM, SamplingParams())


def test_structured_and_prompt_scoring_requests_are_not_handed_off(llama_path):
    pytest.importorskip("xgrammar")  # absent on the lent GPU machine's image
    prefill = engine(llama_path, inprocess_pair()[0])
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match=r"structured_outputs \(also response_format, and "
                                         r"tool_choice required .*\) are not supported"):
        prefill.add_prefill_request("s", SYSTEM, structured)
    with pytest.raises(ValueError,
                       match=r"prompt_logprobs \(also echo with logprobs\) are not supported"):
        prefill.add_prefill_request("p", SYSTEM, SamplingParams(prompt_logprobs=1))
    assert not prefill.has_unfinished()


def test_a_request_too_wide_for_either_engine_is_refused_not_left_waiting(llama_path):
    """n sequences whose prompt K/V the prefill engine cannot hold at once would park forever
    (a parked sequence keeps its blocks); n past the decode engine's max_num_seqs would never
    be admitted there. Each is a ValueError (HTTP 400 served), and nothing is left behind."""
    p, d = inprocess_pair()
    prefill, decode = engine(llama_path, p, num_kv_blocks=8), engine(llama_path, d, max_num_seqs=2)
    tokens = prefill.tokenizer.encode("Will it rain today? " * 30)[:120]  # 7.5 blocks of 16
    with pytest.raises(ValueError, match="needs 9 KV blocks .* n=2 sequences of a 120-token"):
        prefill.add_prefill_request("wide", tokens, SamplingParams(n=2, max_tokens=4))
    assert not prefill.has_unfinished() and "wide" not in prefill.requests
    # 3 shared full blocks and 3 partial ones: 6 of the prefill engine's 8 ...
    prefill.add_prefill_request("n3", tokens[:50], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    while not prefill.kv_exports.exporting:
        prefill.step()
    # ... but not a decode batch of 2
    with pytest.raises(ValueError, match="n=3 sequences, more than this decode engine's max_num_seqs=2"):
        decode.import_request(prefill.take_handoffs()[0])
    prefill.abort("n3")
    assert_all_free(prefill, decode)


def test_the_decode_side_keeps_the_requests_priority(llama_path):
    """scheduling_policy="priority" on both roles: imports wait, join and give way in
    (priority, arrival) order, the priority handed over with the request."""
    p, d = inprocess_pair()
    prefill = engine(llama_path, p, scheduling_policy="priority")
    decode = engine(llama_path, d, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rid, priority in (("late", 5), ("early", -5), ("middle", 0)):
        prefill.add_prefill_request(rid, SYSTEM + rid, params, priority=priority)
    while len(prefill.kv_exports.exporting) < 3:
        prefill.step()
    handoffs = prefill.take_handoffs()
    assert sorted(h.priority for h in handoffs) == [-5, 0, 5]
    for h in sorted(handoffs, key=lambda h: -h.priority):  # arrive latest priority first
        decode.import_request(h)
    done = finish(prefill, decode)
    started = sorted(done, key=lambda rid: done[rid].metrics.finished_time)
    assert started == ["early", "middle", "late"]
    assert_all_free(prefill, decode)
