"""TP / PP shard workers under Ray on CPU (gloo): token-identical to the in-process engine.

One Ray cluster for the module. Each layout runs one mixed batch: greedy prompts of mixed
lengths through a small token budget (chunked prefill next to decodes), a seeded sampled
request and a penalised one; TP 2 x PP 2 also runs with a KV cache small enough to preempt.
"""
import os
import re
import time
import uuid

import psutil
import pytest
import ray

from flagserve import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from flagserve.distributed.placement import host_resource
from tests.conftest import prompt_set

HOST = "10.250.0.9"  # a host label the module's one-node cluster advertises

GRAMMAR_REGEX = "[a-k]{4,12}[.]"
ENGINE = dict(dtype="float32", attention_backend="torch", max_model_len=128,
              max_num_batched_tokens=32)
PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4 + [
    # Its prompt rows' logits come from the LM head of every TP rank, gathered on the first.
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, n=2, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=5,
                   max_tokens=20),
    # The grammar's mask is filled by the engine and sent to the sampling shard with the step.
    SamplingParams(temperature=0.7, seed=11, max_tokens=20, structured_outputs=StructuredOutputsParams(
        regex=GRAMMAR_REGEX)),
]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, resources={host_resource(HOST): 1},
             namespace=f"flagserve-test-{uuid.uuid4().hex[:8]}", include_dashboard=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """arch -> (prompts, token ids of every completion) from the in-process engine."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            llm = LLM(tiny_model_factory(arch), **ENGINE)
            prompts = prompt_set(llm.get_tokenizer(), len(PARAMS), seed=3, max_len=70)
            outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
            cache[arch] = prompts, completions(outputs), prompt_scores(outputs)
        return cache[arch]

    return get


def completions(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def prompt_scores(outputs) -> list[list[tuple[int, float, int]]]:
    """(token, logprob, rank) of every prompt_logprobs entry, the first prompt token's None left out."""
    return [[(t, lp.logprob, lp.rank) for entry in o.prompt_logprobs[1:] for t, lp in entry.items()]
            for o in outputs if o.prompt_logprobs is not None]


# Each layout once (2 cores run them all): llama by heads, qwen3 (q/k norm, head_dim apart
# from hidden / heads) by layers and by both, the last with preemption.
@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 1), ("qwen3", 1, 2), ("qwen3", 2, 2)])
def test_shards_match_single_process(arch, tp, pp, tiny_model_factory, reference):
    prompts, expected, expected_scores = reference(arch)
    preempt = tp * pp == 4
    extra = dict(num_kv_blocks=14) if preempt else {}
    if pp == 2 and tp == 1:
        extra["placement_hosts"] = [HOST, HOST]  # stages pinned by the multi-host runner's label
    llm = LLM(tiny_model_factory(arch), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **ENGINE, **extra)
    try:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert completions(outputs) == expected
        got, want = (sum(prompt_scores(outputs), []), sum(expected_scores, []))
        assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want] and got
        assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(got, want))
        assert re.fullmatch(GRAMMAR_REGEX, outputs[-1].outputs[0].text)
        stats = llm.llm_engine.get_stats()
        assert stats.forward_seconds > 0
        if preempt:
            assert stats.num_preemptions > 0
            assert llm.llm_engine.block_manager.num_free_blocks == 14
    finally:
        llm.llm_engine.shutdown()


def test_idle_cpu_shards_stop_spinning_and_step_again(llama_path, reference, monkeypatch):
    """A compiled graph's readers spin while they wait for a step: after IDLE_TEARDOWN_S
    without one the graph goes and the shards sleep; the next step compiles it again and
    gives the same tokens."""
    from flagserve.engine import ray_executor
    monkeypatch.setattr(ray_executor, "IDLE_TEARDOWN_S", 0.5)
    prompts, expected, _ = reference("llama")
    llm = LLM(llama_path, pipeline_parallel_size=2, placement_hosts=[HOST, HOST], **ENGINE)
    try:
        executor = llm.llm_engine.executor
        assert executor.graph is not None
        shards = [psutil.Process(pid) for pid in ray.get(
            [w.__ray_call__.remote(lambda _: os.getpid()) for w in executor.workers])]
        deadline = time.monotonic() + 10
        while executor.graph is not None:
            assert time.monotonic() < deadline, "the idle graph was not torn down"
            time.sleep(0.1)
        before = [sum(p.cpu_times()[:2]) for p in shards]
        time.sleep(1.0)
        busy = [sum(p.cpu_times()[:2]) - b for p, b in zip(shards, before, strict=True)]
        assert max(busy) < 0.3, busy  # spinning: ~0.9 s of CPU each
        assert completions(llm.generate(prompts, PARAMS, use_tqdm=False)) == expected
        assert executor.graph is not None
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_bfloat16_gathers_its_logits(llama_path):
    """The LM head's shards gather bf16 logits over gloo (the model's dtype, no fp32 copy).
    Only the rounding of the all-reduced partial sums differs from one process, far below
    the tiny model's top-1 margins here: greedy tokens are identical, logprobs within bf16's
    tolerance (test_engine_api.HALF_LOGPROB_TOL)."""
    args = dict(ENGINE, dtype="bfloat16")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    single = LLM(llama_path, **args)
    prompts = prompt_set(single.get_tokenizer(), 3, seed=9, max_len=40)
    expected = [o.outputs[0] for o in single.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(llama_path, tensor_parallel_size=2, **args)
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for g, e in zip(got, expected):
        for g_step, e_step, token in zip(g.logprobs, e.logprobs, g.token_ids):
            assert g_step[token].logprob == pytest.approx(e_step[token].logprob, abs=0.1)


def test_tied_embeddings_on_the_last_stage(tiny_model_factory):
    """qwen2 ties the LM head to the embedding, which only the first stage has."""
    path = tiny_model_factory("qwen2")
    single = LLM(path, **ENGINE)
    prompt = prompt_set(single.get_tokenizer(), 1, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = single.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, pipeline_parallel_size=2, **ENGINE)
    try:
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        llm.llm_engine.shutdown()


def test_unplaceable_shards_fail_clearly(llama_path, monkeypatch):
    monkeypatch.setattr("flagserve.engine.ray_executor.PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=r"need bundles .*host:10\.0\.0\.1"):
        LLM(llama_path, pipeline_parallel_size=2, placement_hosts=["10.0.0.1", HOST])
    assert ray.util.placement_group_table() and all(  # nothing left reserved
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_sampling_state_lives_as_long_as_its_sequence(llama_path):
    """The sampling runner keeps seeded generators per sequence and drops them at the first
    step after the engine reports the sequence finished."""
    llm = LLM(llama_path, **ENGINE)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=3, ignore_eos=True)
    first = llm.generate([[5, 6, 7]] * 3, seeded, use_tqdm=False)
    runner = llm.llm_engine.executor.runner
    assert len(runner.seqs) == 3  # finished, not yet reported
    again = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)
    assert len(runner.seqs) == 1
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


@pytest.mark.parametrize("overrides,words", [
    (dict(tensor_parallel_size=0), "EngineArgs.tensor_parallel_size must be an integer >= 1"),
    (dict(pipeline_parallel_size="2"), "EngineArgs.pipeline_parallel_size must be an integer"),
    (dict(tensor_parallel_size=True), "EngineArgs.tensor_parallel_size must be an integer"),
    (dict(pipeline_parallel_size=2, placement_hosts=["10.0.0.1"]), "EngineArgs.placement_hosts"),
])
def test_bad_parallel_args(overrides, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(model="/m", **overrides)


@pytest.mark.parametrize("overrides,words", [
    (dict(tensor_parallel_size=3),
     "tensor_parallel_size must divide the model's num_attention_heads=4, got 3"),
    (dict(tensor_parallel_size=4),
     "tensor_parallel_size must divide the model's num_key_value_heads=2, got 4"),
    (dict(pipeline_parallel_size=3),
     r"pipeline_parallel_size must be at most the model's 2 layers \(a stage needs one\), got 3"),
])
def test_layouts_the_model_cannot_split(llama_path, overrides, words):
    with pytest.raises(ValueError, match=words):
        LLM(llama_path, **overrides)  # refused before any worker starts
