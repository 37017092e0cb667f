"""Host time per step, phase by phase: where an engine step's time goes outside the model.

Wraps the methods one `LLMEngine.step` calls (scheduling, the step message, the runner's
input buffers, sampling, bookkeeping, outputs) with wall-clock timers on one engine, in
process (TP = PP = 1). On a GPU these phases are the host work the device waits for between
steps unless it overlaps, so their sum per output token says how far a step is from the
device's own floor.
"""
import time
from collections.abc import Callable
from functools import wraps

# (label, owner path from the engine, method name), in the order a step calls them
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("step message", "step_inputs", "build"),
    ("grammar mask", "structured", "bitmask"),
    ("input buffers", "executor.runner", "prepare"),
    ("sampling inputs", "executor.runner", "sampling_batch"),
    ("sampler", "executor.runner.sampler", "sample"),
    ("samples", "", "_process_samples"),
    ("outputs", "", "_outputs"),
)


def _owner(engine, path: str):
    obj = engine
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def _timed(fn: Callable, totals: dict[str, float], label: str) -> Callable:
    @wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
    return run


class _Wrapping:
    """Replaces methods on their objects (instance attributes) and puts back exactly what was
    there, in reverse order: wrappers of one context may sit on another's."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, make: Callable[[Callable], Callable]) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, make(getattr(owner, name)))

    def __exit__(self, *exc) -> None:
        for owner, name, previous in reversed(self._saved):
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._saved.clear()


class PhaseTimer(_Wrapping):
    """Context manager: times PHASES on `engine` (an in-process LLMEngine) while open."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.totals = {label: 0.0 for label, _, _ in PHASES}

    def __enter__(self) -> "PhaseTimer":
        for label, path, name in PHASES:
            self.wrap(_owner(self.engine, path), name,
                      lambda fn, label=label: _timed(fn, self.totals, label))
        return self


def phase_table(totals: dict[str, float], step_seconds: float, forward_seconds: float,
                tokens: int) -> list[tuple[str, float]]:
    """(phase, microseconds per output token) rows: the timed phases, the model, the rest."""
    rows = [(label, secs) for label, secs in totals.items()]
    rows.append(("model forward + logits", forward_seconds))
    rows.append(("rest of the step", step_seconds - forward_seconds - sum(totals.values())))
    return [(label, secs / tokens * 1e6) for label, secs in rows]


# Step kinds of the step mix: steps with prompt tokens, then decode-only steps by rows.
PREFILL = "prefill (any prompt tokens)"
DECODE_ROWS = ((128, "decode >= 128 rows"), (32, "decode 32-127 rows"), (8, "decode 8-31 rows"),
               (1, "decode 1-7 rows"))


def prefilling(seqs) -> bool:
    """Whether any of `seqs` has prompt tokens still to compute (chunked or recomputed)."""
    return any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs)


def step_kind(batch) -> str:
    """A scheduled batch's kind: PREFILL when any of its tokens is a prompt's, else its
    decode bucket."""
    if prefilling(batch.seqs):
        return PREFILL
    return next(label for low, label in DECODE_ROWS if len(batch.seqs) >= low)


class StepMix(_Wrapping):
    """Context manager: wall time and steps of `engine.step` by the kind of batch it ran.
    Step by step (no async scheduling) each step's time is its own device time plus host work,
    so the table says whether a run's time goes to prefills, full batches or the thin tail."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self._kind: str | None = None

    def _schedule(self, schedule: Callable) -> Callable:
        def run():
            batch = schedule()
            self._kind = step_kind(batch) if batch.seqs else None
            if self._kind is not None:
                self.rows[self._kind] = self.rows.get(self._kind, 0) + len(batch.seqs)
            return batch
        return run

    def _step(self, step: Callable) -> Callable:
        def run():
            start = time.perf_counter()
            try:
                return step()
            finally:
                if self._kind is not None:  # an empty step (nothing scheduled) is not counted
                    k = self._kind
                    self.seconds[k] = self.seconds.get(k, 0.0) + time.perf_counter() - start
                    self.steps[k] = self.steps.get(k, 0) + 1
                self._kind = None
        return run

    def __enter__(self) -> "StepMix":
        self.wrap(self.engine.scheduler, "schedule", self._schedule)
        self.wrap(self.engine, "step", self._step)
        return self

    def table(self) -> list[tuple[str, int, float, float, float]]:
        """(kind, steps, seconds, share of the steps' time, mean rows) in the order of kinds."""
        total = sum(self.seconds.values()) or 1.0
        kinds = [PREFILL] + [label for _, label in DECODE_ROWS]
        return [(k, self.steps[k], self.seconds[k], self.seconds[k] / total,
                 self.rows[k] / self.steps[k]) for k in kinds if self.steps.get(k)]
