"""The Triton kernel variants a stretch of code met for the first time in this process.

A variant (one specialization of a kernel: its constexprs, and the integers Triton specializes
on, such as 16-divisible strides) is compiled, or read from the on-disk cache, the first time
it is launched; on a fresh machine that costs ~1 s a kernel inside whatever runs it. A benchmark
reports the variants its timed run met so a slow first run can be told from a slow engine.
"""
import contextlib
from collections.abc import Iterator

try:
    from triton import knobs
except ImportError:  # an older Triton, or none: nothing is recorded
    knobs = None


@contextlib.contextmanager
def recorded() -> Iterator[list[str] | None]:
    """Yields the list the variants' descriptions are appended to (None where this Triton
    cannot tell). Kernels run interpreted (TRITON_INTERPRET) are never compiled."""
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        yield None
        return
    seen: list[str] = []
    previous = knobs.runtime.jit_cache_hook

    def hook(*, repr: str, **kwargs) -> bool:  # noqa: A002  # Triton's keyword
        seen.append(repr)
        return bool(previous and previous(repr=repr, **kwargs))  # True would skip the compile

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous
