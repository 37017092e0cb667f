"""The thread count of a CPU engine on shared cores, chosen by measuring (issue 16).

On a machine whose cores other processes also use, two OpenMP threads can run a step 1.3x
faster than one (the second core is free) or 1.8x slower (it is not: every op ends at a
barrier that waits for the thread whose core is taken), and which holds changes by the
minute (docs/performance.md, CPU). So every `period` steps the engine runs a short trial: a
few pairs of consecutive steps, one with each count (ABBA order), and keeps the count whose
steps ran faster per token by more than `margin`. Only a pair whose token counts are within
`similar` of each other is compared: a served engine under load rarely runs two decode-only
steps of one batch size in a row (arrivals put prefill tokens into nearly every step), so
requiring that left the tuner idle exactly where it was needed. The trial costs the slower
count's extra time on a few steps out of `period`, so each trial that keeps the count doubles
the wait before the next (up to `max_period`: ~4% of a quiet server's throughput at 64 steps).
A switch needs `min_pairs` comparable pairs and is tried again after `first` steps: served
SmolLM2 went to one thread on a single pair in its first second and stayed there ~50 s (a
period of its slow steps) at two thirds of the throughput (docs/performance.md, CPU,
2026-11-26), so a switch is now confirmed or undone at once. Leaving the engine's own count
(one thread per owned core) needs `leave_margin`, returning to it `margin`: a wrong switch
away costs most (a served engine that left on a noisy trial ran at two thirds of its
throughput until it came back, while a core held by another process shows a gap far wider
than `leave_margin`: docs/performance.md, CPU). Steps of more than `max_tokens` (a burst's
long prefills) take part only off the engine's own count: one of them run on the slower
count costs seconds, but a saturated server on one thread runs nothing else, and waiting for
short steps kept that wrong switch for minutes.
A trial whose first pair ran `hopeless` (1.5x) slower per token on the other count ends
there: on a quiet machine one thread runs a decode step far slower, and the two more such
steps of a whole trial cost more than they could tell (docs/performance.md, CPU).

FLAGSERVE_CPU_THREAD_TUNING=on (default where the engine has more than one thread) | off.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

from kernels.env import TUNING_ENV, Switch, env_choice

log = logging.getLogger(__name__)


def tuning_enabled(num_threads: int, env: dict[str, str] | None = None) -> bool:
    return env_choice(TUNING_ENV, Switch, "on", environ=env) == "on" and num_threads > 1


class ThreadTuner:
    def __init__(self, counts: tuple[int, int], set_threads: Callable[[int], None],
                 period: int = 64, pairs: int = 3, margin: float = 0.05, similar: float = 1.25,
                 first: int = 8, max_period: int = 512, max_tokens: int = 512,
                 min_pairs: int = 2, hopeless: float = 1.5, leave_margin: float = 0.2):
        self.counts, self.set_threads = counts, set_threads
        self.best, self.current = counts[0], counts[0]
        self.period, self.pairs, self.margin, self.similar = period, pairs, margin, similar
        self.base_period, self.max_period, self.max_tokens = period, max_period, max_tokens
        self.first, self.min_pairs, self.hopeless = first, min_pairs, hopeless
        self.leave_margin = leave_margin
        # steps since the last trial ended; the first trial comes after `first` steps, not a
        # whole period: a loaded server's steps take up to a second each
        self.since_trial = period - first
        self.plan: list[int] = []  # thread counts of the trial's remaining steps
        self.samples: list[tuple[int, int, float]] = []  # (tokens, threads, seconds)
        self.step: tuple[int | None, int, bool] = (None, self.best, False)

    @property
    def other(self) -> int:
        """The count that is not the best."""
        return self.counts[1] if self.best == self.counts[0] else self.counts[0]

    def start(self, tokens: int | None) -> None:
        """Before a step of `tokens` scheduled tokens (None: a step that never takes part)."""
        if tokens is not None and tokens > self.max_tokens and self.best == self.counts[0]:
            tokens = None
        if tokens is not None and not self.plan and self.since_trial >= self.period:
            self.plan = [self.best, self.other, self.other, self.best] * (self.pairs // 2 + 1)
            self.plan = self.plan[:2 * self.pairs]
            self.samples = []
        trial = tokens is not None and bool(self.plan)
        self.current = self.plan[0] if trial else self.best
        self.set_threads(self.current)  # every step: cheap, and nobody else's setting sticks
        self.step = (tokens, self.current, trial)

    def finish(self, seconds: float) -> None:
        tokens, threads, trial = self.step
        if tokens is None:
            return
        if not trial:
            self.since_trial += 1
            return
        self.plan.pop(0)
        self.samples.append((tokens, threads, seconds))
        if len(self.samples) == 2 and (first := self._speedups()) and first[0] < 1 / self.hopeless:
            self.plan = []  # why: the class docstring, "hopeless"
        if not self.plan:
            best, self.best = self.best, self._winner()
            kept = best == self.best
            self.period = min(2 * self.period, self.max_period) if kept else self.base_period
            self.since_trial = 0 if kept else self.period - self.first

    def _speedups(self) -> list[float]:
        """Per pair of similar token counts, how much faster per token the other count ran."""
        speedups = []
        for a, b in zip(self.samples[::2], self.samples[1::2]):
            if max(a[0], b[0]) <= self.similar * min(a[0], b[0]):  # comparable steps
                mine, other = (a, b) if a[1] == self.best else (b, a)
                speedups.append((mine[2] / mine[0]) / (other[2] / other[0]))
        return speedups

    def _winner(self) -> int:
        """The other count if its steps took less time per token than the best's, pair by
        pair (at least `min_pairs` pairs), by more than the margin of that direction."""
        speedups = self._speedups()
        speedup = statistics.median(speedups) if len(speedups) >= self.min_pairs else 1.0
        if speedup > 1 + (self.margin if self.other == self.counts[0] else self.leave_margin):
            log.info("torch threads %d -> %d: its steps ran %.2fx as fast per token (median of "
                     "%d pairs)", self.best, self.other, speedup, len(speedups))
            return self.other
        return self.best
