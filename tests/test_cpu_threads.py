"""The CPU engine's thread-count trials (flagserve/engine/cpu_threads.py), on fake timings."""
import pytest

from flagserve.engine.cpu_threads import ThreadTuner, tuning_enabled


def run(tuner: ThreadTuner, seconds: dict[int, float], steps: int, batch: int | None = 8) -> list[int]:
    """`steps` steps whose time depends only on the thread count; the counts they ran with."""
    used = []
    for _ in range(steps):
        tuner.start(batch)
        used.append(tuner.current)
        tuner.finish(seconds[tuner.current])
    return used


def make(set_calls: list[int]) -> ThreadTuner:
    return ThreadTuner((2, 1), set_calls.append, period=10, pairs=3, first=10)


def test_switches_to_the_faster_count_and_back(caplog):
    caplog.set_level("INFO", logger="flagserve.engine.cpu_threads")
    calls: list[int] = []
    tuner = make(calls)
    used = run(tuner, {2: 0.18, 1: 0.10}, 10 + 6)  # one thread faster: the second core is busy
    assert used[:10] == [2] * 10 and sorted(used[10:]) == [1, 1, 1, 2, 2, 2]
    assert tuner.best == 1
    assert "torch threads 2 -> 1: its steps ran 1.80x as fast per token" in caplog.text
    assert run(tuner, {2: 0.18, 1: 0.10}, 10) == [1] * 10
    run(tuner, {2: 0.07, 1: 0.10}, 6)  # the next trial: the core is free again
    assert tuner.best == 2 and calls[-1] == 2


def test_keeps_the_count_within_the_margin_or_slower():
    tuner = make([])
    run(tuner, {2: 0.100, 1: 0.098}, 16)  # 2% faster: not worth switching
    assert tuner.best == 2
    run(tuner, {2: 0.1, 1: 0.3}, 16)
    assert tuner.best == 2


def test_leaving_the_engines_own_count_needs_the_larger_margin():
    """One thread 1.1x faster: noise at served scale, not a held core; two threads 1.1x faster
    after a switch: back at once."""
    tuner = make([])
    run(tuner, {2: 0.110, 1: 0.100}, 16)
    assert tuner.best == 2
    run(tuner, {2: 0.2, 1: 0.1}, tuner.period + 6)  # a held core: 2x
    assert tuner.best == 1
    run(tuner, {2: 0.100, 1: 0.110}, tuner.period - tuner.since_trial + 6)
    assert tuner.best == 2


def test_a_hopeless_first_pair_ends_the_trial():
    tuner = make([])
    used = run(tuner, {2: 0.1, 1: 0.16}, 10 + 6)  # one thread 1.6x slower: one pair is enough
    assert used == [2] * 10 + [2, 1] + [2] * 4 and tuner.best == 2 and tuner.period == 20
    tuner = make([])
    used = run(tuner, {2: 0.1, 1: 0.14}, 10 + 6)  # 1.4x: the whole trial, in case it was noise
    assert used == [2] * 10 + [2, 1, 1, 2, 2, 1] and tuner.best == 2


def test_the_first_trial_comes_early():
    tuner = ThreadTuner((2, 1), [].append, period=64, pairs=3, first=8)
    assert run(tuner, {2: 0.2, 1: 0.1}, 14) == [2] * 8 + [2, 1, 1, 2, 2, 1]
    assert tuner.best == 1


def test_trials_that_keep_the_count_come_less_often_until_one_switches():
    tuner = ThreadTuner((2, 1), [].append, period=10, pairs=3, first=10, max_period=40)
    periods = []
    for _ in range(4):
        run(tuner, {2: 0.1, 1: 0.2}, tuner.period + 6)  # two threads stay faster
        periods.append(tuner.period)
    assert periods == [20, 40, 40, 40] and tuner.best == 2
    run(tuner, {2: 0.2, 1: 0.1}, tuner.period - tuner.since_trial + 6)  # now one is: a switch, and back to 10
    assert tuner.best == 1 and tuner.period == 10


def test_steps_of_unlike_sizes_decide_nothing():
    tuner = make([])
    assert run(tuner, {2: 0.5, 1: 0.1}, 30, batch=None) == [2] * 30  # never a trial
    assert run(tuner, {2: 0.5, 1: 0.1}, 30, batch=4096) == [2] * 30  # too long to try
    run(tuner, {2: 0.5, 1: 0.1}, 10)
    for tokens in (8, 64, 8, 64, 8, 64):  # every pair: 8x apart, not comparable
        tuner.start(tokens)
        tuner.finish(0.5 if tuner.current == 2 else 0.1)
    assert tuner.best == 2 and not tuner.plan


def test_long_steps_take_part_off_the_engines_own_count():
    """A saturated server on one thread runs only long steps: they must not stop the trial
    that brings the second thread back."""
    tuner = make([])
    run(tuner, {2: 0.2, 1: 0.1}, 16)
    assert tuner.best == 1
    used = run(tuner, {2: 1.0, 1: 2.0}, 10 + 6, batch=4096)
    assert sorted(used[10:]) == [1, 1, 1, 2, 2, 2] and tuner.best == 2
    assert run(tuner, {2: 2.0, 1: 1.0}, 100, batch=4096) == [2] * 100  # on two: never tried


def test_mixed_steps_of_similar_sizes_compare_per_token():
    """Served under load nearly every step carries prefill tokens: the trial uses them."""
    tuner = make([])
    run(tuner, {2: 1.0, 1: 1.0}, 10, batch=160)
    for tokens in (160, 180, 170, 150, 160, 190):  # one thread: 0.5 ms a token; two: 1 ms
        tuner.start(tokens)
        tuner.finish(tokens * (0.001 if tuner.current == 2 else 0.0005))
    assert tuner.best == 1
    run(tuner, {2: 1.0, 1: 1.0}, 10, batch=160)
    for tokens in (160, 100, 100, 160, 160, 100):  # per token equal, pair sizes 1.6x apart
        tuner.start(tokens)
        tuner.finish(tokens * 0.001)
    assert tuner.best == 1


def test_one_comparable_pair_switches_nothing():
    tuner = make([])
    run(tuner, {2: 1.0, 1: 1.0}, 10)
    for tokens in (8, 8, 8, 64, 8, 64):  # only the first pair is comparable, 3x faster on one
        tuner.start(tokens)
        tuner.finish(0.3 if tuner.current == 2 else 0.1)
    assert tuner.best == 2


def test_a_switch_is_tried_again_soon():
    """A switch on a noisy trial must not hold for a whole period of slow steps."""
    tuner = ThreadTuner((2, 1), [].append, period=64, pairs=3, first=8)
    run(tuner, {2: 0.2, 1: 0.1}, 8 + 6)  # first trial: one thread wins
    assert tuner.best == 1
    used = run(tuner, {2: 0.1, 1: 0.2}, 8 + 6)  # the next trial after 8 steps, not 64
    assert used[:8] == [1] * 8 and sorted(used[8:]) == [1, 1, 1, 2, 2, 2]
    assert tuner.best == 2


def test_enabled_only_with_several_threads():
    assert tuning_enabled(2, {}) and not tuning_enabled(1, {})
    assert not tuning_enabled(2, {"FLAGSERVE_CPU_THREAD_TUNING": "off"})
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_THREAD_TUNING"):
        tuning_enabled(2, {"FLAGSERVE_CPU_THREAD_TUNING": "auto"})


def test_offline_generate_leaves_the_callers_thread_count(llama_path, monkeypatch):
    """The tuner sets torch's (process-wide) count every step; its first trial runs a step on
    one thread. generate() ends with the caller's count: a later LLM starts on every core
    (with a tuner), and the caller's own work is not left on one thread."""
    import torch

    from flagserve import LLM, SamplingParams
    monkeypatch.setenv("FLAGSERVE_CPU_THREAD_TUNING", "on")
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("needs 2 threads")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # into the trial
    first = LLM(llama_path, dtype="float32")
    assert first.llm_engine.executor.runner.thread_tuner is not None
    first.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert torch.get_num_threads() == before
    second = LLM(llama_path, dtype="float32")
    assert second.llm_engine.executor.runner.thread_tuner is not None
