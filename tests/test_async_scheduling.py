"""Async scheduling (EngineArgs.async_scheduling) gives every request exactly what the step-by-
step engine gives it: the step in flight only changes when the host learns its tokens."""
import pytest

from flagserve import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams, StructuredOutputsParams
from flagserve.engine.executor import InProcessExecutor
from tests.conftest import prompt_set

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llama_path):
    return prompt_set(LLM(llama_path).get_tokenizer(), 16, seed=3)


@pytest.fixture
def pending_counts(monkeypatch):
    """Per launched step, how many input tokens it took from the step before's samples."""
    counts = []
    launch = InProcessExecutor.launch

    def spy(self, step):
        counts.append(len(step.pending_positions))
        return launch(self, step)

    monkeypatch.setattr(InProcessExecutor, "launch", spy)
    return counts


def both(llama_path, prompts, params, **engine_args) -> tuple[list, list, LLM]:
    """(step-by-step outputs, async outputs, the async LLM): the same requests through each."""
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(llama_path, dtype="float32", async_scheduling=async_scheduling, **engine_args)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    return outs[0], outs[1], llm


def completions(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def test_greedy_with_preemption_and_chunks(llama_path, prompts, pending_counts):
    sync, overlapped, llm = both(llama_path, prompts, GREEDY, num_kv_blocks=10, max_model_len=160,
                                 max_num_batched_tokens=24, max_num_seqs=6)
    assert completions(overlapped) == completions(sync)
    engine = llm.llm_engine
    assert engine.get_stats().num_preemptions > 0
    assert sum(pending_counts) > len(pending_counts)  # decode inputs did come from the device
    assert engine.block_manager.num_free_blocks == 10  # nothing leaked


def test_seeded_sampling_logprobs_and_n(llama_path, prompts):
    params = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=16, logprobs=3,
                            ignore_eos=True)
    sync, overlapped, _ = both(llama_path, prompts[:8], params)
    assert completions(overlapped) == completions(sync)
    # Within rounding: a step of the async run may hold one more (void) row, and a GEMM of
    # another height may round differently (bitwise equal on this CPU).
    for a, b in zip(sync, overlapped):
        for x, y in zip(a.outputs, b.outputs):
            assert [sorted((t, lp.rank) for t, lp in d.items()) for d in x.logprobs] == \
                [sorted((t, lp.rank) for t, lp in d.items()) for d in y.logprobs]
            got = [lp.logprob for d in y.logprobs for lp in d.values()]
            assert got == pytest.approx([lp.logprob for d in x.logprobs for lp in d.values()], abs=1e-5)
            assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-4)


def test_sequences_that_end_while_the_next_step_runs(llama_path, prompts):
    """Stop strings, stop token ids and EOS end a sequence one step after it was scheduled
    again: that step's sample is dropped and its blocks come back."""
    tokenizer = LLM(llama_path).get_tokenizer()
    first = LLM(llama_path, dtype="float32").generate(prompts[:6], GREEDY, use_tqdm=False)
    stop_ids = [o.outputs[0].token_ids[5] for o in first[:3]]
    stop_text = [tokenizer.decode(o.outputs[0].token_ids[8:10]) for o in first[3:]]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stop_ids,
                            stop=[t for t in stop_text if t.strip()])
    sync, overlapped, llm = both(llama_path, prompts, params, num_kv_blocks=64, max_model_len=1024)
    assert completions(overlapped) == completions(sync)
    assert {o.outputs[0].finish_reason for o in sync} >= {"stop"}
    assert llm.llm_engine.block_manager.num_free_blocks == 64


def test_grammars_penalties_and_prompt_scores_run_step_by_step_beside_the_rest(llama_path, prompts):
    pytest.importorskip("xgrammar")  # absent on the lent GPU machine's image
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in range(4)]
    penalized = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                repetition_penalty=1.3, frequency_penalty=0.4) for _ in range(2)]
    scored = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)] * 2
    constrained = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta", "gamma delta"])) for _ in range(2)]
    params = plain + penalized + scored + constrained
    sync, overlapped, _ = both(llama_path, prompts[:len(params)], params, max_num_batched_tokens=32)
    assert completions(overlapped) == completions(sync)
    assert all(o.outputs[0].text in ("alpha", "beta", "gamma delta") for o in overlapped[-2:])
    for a, b in zip(sync[6:8], overlapped[6:8]):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert [e and {t: lp.rank for t, lp in e.items()} for e in b.prompt_logprobs] == \
            [e and {t: lp.rank for t, lp in e.items()} for e in a.prompt_logprobs]


def test_deltas_and_aborts(llama_path, prompts):
    """Streamed deltas add up to the step-by-step text; an abort while its step is in flight
    ends the request with no output and frees its blocks."""
    def run(async_scheduling: bool) -> dict[str, list]:
        engine = LLMEngine(EngineArgs(model=llama_path, dtype="float32", num_kv_blocks=64,
                                      max_model_len=1024, async_scheduling=async_scheduling))
        delta = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               output_kind=RequestOutputKind.DELTA)
        for i, prompt in enumerate(prompts[:5]):
            engine.add_request(str(i), prompt, delta)
        got: dict[str, list] = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).append(out.outputs[0])
            steps += 1
            if steps == 6:
                engine.abort("2")
        assert engine.block_manager.num_free_blocks == 64
        return {r: ("".join(c.text for c in cs), sum((c.token_ids for c in cs), []), cs[-1].finish_reason)
                for r, cs in got.items()}

    sync, overlapped = run(False), run(True)
    assert set(sync) == set(overlapped) == {"0", "1", "2", "3", "4"}
    for request_id in ("0", "1", "3", "4"):
        assert overlapped[request_id] == sync[request_id]
    # Request 2 streamed until its abort; one step later when its tokens land a step later.
    assert sync["2"][2] is None and overlapped["2"][2] is None
    assert sync["2"][1][:len(overlapped["2"][1])] == overlapped["2"][1]


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_needs_the_engine_in_one_process(layout):
    with pytest.raises(ValueError, match="EngineArgs.async_scheduling needs the engine in one process"):
        EngineArgs(model="m", async_scheduling=True, **layout)
    with pytest.raises(ValueError, match="EngineArgs.async_scheduling must be true, false or null"):
        EngineArgs(model="m", async_scheduling="yes")
    assert not EngineArgs(model="m", **layout).overlaps_steps("cuda")  # auto: off where it can't


def test_auto_is_on_for_cuda_in_one_process_only():
    auto = EngineArgs(model="m")
    assert auto.async_scheduling is None
    assert auto.overlaps_steps("cuda") and not auto.overlaps_steps("cpu")
    assert not auto.overlaps_steps("cuda", kv_transport=object())  # a given transport: no overlap
    assert EngineArgs(model="m", async_scheduling=True).overlaps_steps("cpu")
    assert not EngineArgs(model="m", async_scheduling=False).overlaps_steps("cuda")


def test_engine_resolves_auto_by_its_device(llama_path):
    llm = LLM(llama_path, dtype="float32", device="cpu")
    assert llm.llm_engine.async_scheduling is False


def test_prefix_cache_sees_the_blocks_completed_by_pending_tokens(llama_path, prompts):
    """A block that a pending token completes is hashed a step later, once the token is
    known: a follow-up that repeats a finished request's prompt and output hits as many
    cached tokens as step by step."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm = LLM(llama_path, dtype="float32", async_scheduling=async_scheduling)
        [first] = llm.generate([prompts[0]], params, use_tqdm=False)
        follow_up = prompts[0] + first.outputs[0].token_ids
        [second] = llm.generate([follow_up], params, use_tqdm=False)
        hits.append((second.num_cached_tokens, second.outputs[0].token_ids))
    assert hits[1] == hits[0] and hits[0][0] >= len(prompts[0]) + 16


def test_padded_decode_steps(llama_path, prompts):
    """The CUDA-graph-shaped path (decode steps padded to buckets, run eagerly on CPU) takes its
    pending inputs the same way: the same tokens as step by step on that path."""
    from tests.test_cuda_graph_buckets import padded_rows

    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(10)]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(llama_path, dtype="float32", async_scheduling=async_scheduling, max_num_seqs=12)
        seen = padded_rows(llm)
        outs.append(completions(llm.generate(prompts[:10], params, use_tqdm=False)))
        assert any(rows > n for rows, n in seen)  # padded steps ran
    assert outs[1] == outs[0]


def test_sequences_that_reach_max_model_len(llama_path, prompts):
    """A sequence ended by max_model_len ran one more (void) step at the last position: it
    must stay inside its block table and the cache, and change nothing else."""
    short = [p[:30] for p in prompts[:6]]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    sync, overlapped, llm = both(llama_path, short, params, max_model_len=48, num_kv_blocks=24)
    assert completions(overlapped) == completions(sync)
    assert all(len(p) + len(o.outputs[0].token_ids) == 48 and o.outputs[0].finish_reason == "length"
               for p, o in zip(short, overlapped))
    assert llm.llm_engine.block_manager.num_free_blocks == 24


def test_no_step_past_max_tokens_or_model_length(llama_path, prompts, monkeypatch):
    """A sequence whose last token (by max_tokens or max_model_len) is in flight gets no step
    after it: async runs exactly the rows the step-by-step engine runs."""
    rows = []

    def counted(run):
        def spy(self, step):
            rows[-1] += step.num_tokens
            return run(self, step)
        return spy
    monkeypatch.setattr(InProcessExecutor, "launch", counted(InProcessExecutor.launch))
    monkeypatch.setattr(InProcessExecutor, "execute", counted(InProcessExecutor.execute))
    # the last ends by the model's length (prompts of up to 76 tokens)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, None)]
    for async_scheduling in (False, True):
        rows.append(0)
        llm = LLM(llama_path, dtype="float32", async_scheduling=async_scheduling, max_model_len=96)
        outs = llm.generate(prompts[:3], params, use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    assert rows[1] == rows[0], rows
