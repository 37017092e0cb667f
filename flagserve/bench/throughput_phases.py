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


class PhaseTimer:
    """Context manager: times PHASES on `engine` (an in-process LLMEngine) while open."""

    def __init__(self, engine):
        self.engine = engine
        self.totals = {label: 0.0 for label, _, _ in PHASES}
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "PhaseTimer":
        for label, path, name in PHASES:
            owner = _owner(self.engine, path)
            self._saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, _timed(getattr(owner, name), self.totals, label))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, previous in reversed(self._saved):
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._saved.clear()


def phase_table(totals: dict[str, float], step_seconds: float, forward_seconds: float,
                tokens: int) -> list[tuple[str, float]]:
    """(phase, microseconds per output token) rows: the timed phases, the model, the rest."""
    rows = [(label, secs) for label, secs in totals.items()]
    rows.append(("model forward + logits", forward_seconds))
    rows.append(("rest of the step", step_seconds - forward_seconds - sum(totals.values())))
    return [(label, secs / tokens * 1e6) for label, secs in rows]
