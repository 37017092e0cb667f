"""Continuous batching, chunked prefill and preemption never change what a request gets."""
import pytest

from flagserve import LLM, EngineArgs, LLMEngine, SamplingParams
from flagserve.engine.scheduler import Scheduler
from tests.conftest import prompt_set

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llama_path):
    return prompt_set(LLM(llama_path).get_tokenizer(), 20, seed=1)


@pytest.fixture(scope="module")
def reference(llama_path, prompts):
    """Each prompt generated on its own, with nothing else in the batch."""
    llm = LLM(llama_path, dtype="float32")
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_equals_alone(llama_path, prompts, reference):
    assert len({len(p) for p in prompts}) > 10  # genuinely mixed lengths
    llm = LLM(llama_path, dtype="float32")
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_tiny_kv_cache_forces_preemption(llama_path, prompts, reference):
    # 12 blocks of 16 tokens: room for about two sequences of 90 + 32 tokens at once.
    llm = LLM(llama_path, dtype="float32", num_kv_blocks=12, max_model_len=192)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert token_ids(outs) == reference
    assert llm.llm_engine.block_manager.num_free_blocks == 12  # nothing leaked


def test_small_token_budget_forces_chunked_prefill(llama_path, prompts, reference, monkeypatch):
    partial_chunks = []
    schedule = Scheduler.schedule

    def spy(self):
        batch = schedule(self)
        partial_chunks.extend(n for s, n in zip(batch.seqs, batch.num_new_tokens)
                              if n > 1 and s.num_computed_tokens + n < s.num_tokens)
        assert batch.num_tokens <= self.config.max_num_batched_tokens
        return batch

    monkeypatch.setattr(Scheduler, "schedule", spy)
    llm = LLM(llama_path, dtype="float32", max_num_batched_tokens=24)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert partial_chunks, "no prompt was split into chunks"


def test_preemption_and_chunking_together(llama_path, prompts, reference):
    llm = LLM(llama_path, dtype="float32", num_kv_blocks=12, max_model_len=192,
              max_num_batched_tokens=20, max_num_seqs=6)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_without_chunked_prefill(llama_path, prompts, reference):
    llm = LLM(llama_path, dtype="float32", enable_chunked_prefill=False, max_model_len=256,
              max_num_batched_tokens=256, enable_prefix_caching=False)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_unchunked_budget_must_hold_a_prompt(llama_path):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(llama_path, enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=64)


def test_requests_join_and_leave_every_step(llama_path):
    # Step by step (async scheduling, on by default on CUDA, lands each step's tokens a step later)
    engine = LLMEngine(EngineArgs(model=llama_path, dtype="float32", async_scheduling=False))
    engine.add_request("a", "The weather today", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        assert [o.request_id for o in engine.step()] == ["a"]
    engine.add_request("b", "We cook rice", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = [{o.request_id: o.finished for o in engine.step()} for _ in range(4)]
    assert steps[0] == {"a": False, "b": False}  # b joined the running batch at once
    assert steps[2] == {"a": True, "b": False}  # a's 6th and last token
    assert steps[3] == {"b": False}  # a left the batch, b keeps going
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_queued_prompt_tokens_count_what_is_left_to_prefill(llama_path):
    """What a prefill role autoscales on (serve/autoscaling.py): prompt tokens not yet computed."""
    engine = LLMEngine(EngineArgs(model=llama_path, dtype="float32", max_num_batched_tokens=24,
                                  enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(5, 45)), params)  # 40 tokens
    engine.add_request("b", list(range(50, 60)), params)  # 10 tokens
    assert engine.get_stats().queued_prompt_tokens == 50
    engine.step()  # 24 of a's 40
    assert engine.get_stats().queued_prompt_tokens == 26
    engine.step()  # a's last 16, then 8 of b's 10
    assert engine.get_stats().queued_prompt_tokens == 2
    engine.step()  # a decodes; b's last 2: every prompt computed, decodes are not counted
    assert engine.get_stats().queued_prompt_tokens == 0


def test_priority_policy_orders_admission_and_preemption(llama_path, prompts, reference, monkeypatch):
    """scheduling_policy="priority" (vLLM's): a lower priority runs first, among equals the
    earlier arrival; under a tiny cache the latest priority is preempted. Tokens never change."""
    ranks = [(7 * i) % 5 - 2 for i in range(len(prompts))]  # -2..2, mixed with arrival order
    one_at_a_time = LLM(llama_path, dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    outs = one_at_a_time.generate(prompts, GREEDY, use_tqdm=False, priority=ranks)
    assert token_ids(outs) == reference
    started = sorted(range(len(prompts)), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == sorted(range(len(prompts)), key=lambda i: (ranks[i], i))
    tiny = LLM(llama_path, dtype="float32", num_kv_blocks=12, max_model_len=192,
               scheduling_policy="priority")
    scheduler = tiny.llm_engine.scheduler
    real, victims = getattr(scheduler, "_preempt"), []  # noqa: B009 - a private hook, wrapped

    def preempt(seq):  # the victim is the latest in (priority, arrival) of what was running
        key = (seq.priority, seq.arrival_time, seq.seq_id)
        victims.append(all(key > (s.priority, s.arrival_time, s.seq_id) for s in scheduler.running))
        real(seq)
    monkeypatch.setattr(scheduler, "_preempt", preempt)
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False, priority=ranks)
    assert token_ids(outs) == reference and victims and all(victims)


def test_priority_needs_the_priority_policy(llama_path):
    llm = LLM(llama_path, dtype="float32")
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="1 prompts but 2 priorities"):
        llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[0, 0])
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[0])[0].finished
