"""The thread count of a CPU engine on shared cores, chosen by measuring (issue 16).

On a machine whose cores other processes also use, two OpenMP threads can run a step 1.3x
faster than one (the second core is free) or 1.8x slower (it is not: every op ends at a
barrier that waits for the thread whose core is taken), and which holds changes by the
minute (docs/performance.md, CPU). So every `period` decode steps the engine runs a short
trial: a few pairs of consecutive decode steps of the same batch size, one step with each
count (ABBA order), and keeps the count whose steps ran faster by more than `margin`. The
trial costs the slower count's extra time on a few steps out of `period`.

FLAGSERVE_CPU_THREAD_TUNING=on (default where the engine has more than one thread) | off.
"""
from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable

log = logging.getLogger(__name__)

TUNING_ENV = "FLAGSERVE_CPU_THREAD_TUNING"


def tuning_enabled(num_threads: int, env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(TUNING_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{TUNING_ENV} must be on or off, got {value!r}")
    return value == "on" and num_threads > 1


class ThreadTuner:
    def __init__(self, counts: tuple[int, int], set_threads: Callable[[int], None],
                 period: int = 64, pairs: int = 3, margin: float = 0.05):
        self.counts, self.set_threads = counts, set_threads
        self.best, self.current = counts[0], counts[0]
        self.period, self.pairs, self.margin = period, pairs, margin
        self.since_trial = 0  # decode steps since the last trial ended
        self.plan: list[int] = []  # thread counts of the trial's remaining steps
        self.samples: list[tuple[int, int, float]] = []  # (batch, threads, seconds)
        self.step: tuple[int | None, int, bool] = (None, self.best, False)

    def start(self, batch: int | None) -> None:
        """Before a step; `batch` is its sequence count if it is decode-only, else None
        (prefill steps differ too much to compare, and never take part in a trial)."""
        if batch is not None and not self.plan and self.since_trial >= self.period:
            other = next(c for c in self.counts if c != self.best)
            self.plan = [self.best, other, other, self.best] * (self.pairs // 2 + 1)
            self.plan = self.plan[:2 * self.pairs]
            self.samples = []
        trial = batch is not None and bool(self.plan)
        self.current = self.plan[0] if trial else self.best
        self.set_threads(self.current)  # every step: cheap, and nobody else's setting sticks
        self.step = (batch, self.current, trial)

    def finish(self, seconds: float) -> None:
        batch, threads, trial = self.step
        if batch is None:
            return
        if not trial:
            self.since_trial += 1
            return
        self.plan.pop(0)
        self.samples.append((batch, threads, seconds))
        if not self.plan:
            self.best = self._winner()
            self.since_trial = 0

    def _winner(self) -> int:
        """The other count if its steps took less time than the best's, pair by pair."""
        speedups = []
        for a, b in zip(self.samples[::2], self.samples[1::2]):
            if a[0] == b[0]:  # the same batch size: comparable steps
                mine, other = (a, b) if a[1] == self.best else (b, a)
                speedups.append(mine[2] / other[2])
        if speedups and statistics.median(speedups) > 1 + self.margin:
            other = next(c for c in self.counts if c != self.best)
            log.info("torch threads %d -> %d: its decode steps ran %.2fx as fast (median of %d "
                     "pairs)", self.best, other, statistics.median(speedups), len(speedups))
            return other
        return self.best
