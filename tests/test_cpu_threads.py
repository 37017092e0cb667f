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
    return ThreadTuner((2, 1), set_calls.append, period=10, pairs=3)


def test_switches_to_the_faster_count_and_back(caplog):
    caplog.set_level("INFO", logger="flagserve.engine.cpu_threads")
    calls: list[int] = []
    tuner = make(calls)
    used = run(tuner, {2: 0.18, 1: 0.10}, 10 + 6)  # one thread faster: the second core is busy
    assert used[:10] == [2] * 10 and sorted(used[10:]) == [1, 1, 1, 2, 2, 2]
    assert tuner.best == 1
    assert "torch threads 2 -> 1: its decode steps ran 1.80x as fast" in caplog.text
    assert run(tuner, {2: 0.18, 1: 0.10}, 10) == [1] * 10
    run(tuner, {2: 0.07, 1: 0.10}, 6)  # the next trial: the core is free again
    assert tuner.best == 2 and calls[-1] == 2


def test_keeps_the_count_within_the_margin_or_slower():
    tuner = make([])
    run(tuner, {2: 0.100, 1: 0.098}, 16)  # 2% faster: not worth switching
    assert tuner.best == 2
    run(tuner, {2: 0.1, 1: 0.3}, 16)
    assert tuner.best == 2


def test_prefill_steps_and_changing_batches_decide_nothing():
    tuner = make([])
    assert run(tuner, {2: 0.5, 1: 0.1}, 30, batch=None) == [2] * 30  # never a trial
    run(tuner, {2: 0.5, 1: 0.1}, 10)
    for batch in range(8, 2, -1):  # every pair has two batch sizes: no comparable pair
        tuner.start(batch)
        tuner.finish(0.5 if tuner.current == 2 else 0.1)
    assert tuner.best == 2 and not tuner.plan


def test_enabled_only_with_several_threads():
    assert tuning_enabled(2, {}) and not tuning_enabled(1, {})
    assert not tuning_enabled(2, {"FLAGSERVE_CPU_THREAD_TUNING": "off"})
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_THREAD_TUNING"):
        tuning_enabled(2, {"FLAGSERVE_CPU_THREAD_TUNING": "auto"})
