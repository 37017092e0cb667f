"""torch.compile (inductor) of the elementwise chains of a CPU model (issue 16).

Between the matmuls (oneDNN, already one call each) and the attention, a decoder layer runs
two RMSNorms (one fused with the residual add) and SiLU-and-mul: about a dozen eager torch
ops that each read and write the activations once (aten::mul alone was 8% of a SmolLM2 run,
docs/performance.md). Inductor turns each of these functions into one generated C++ loop.
They are compiled per function, not per layer: every layer calls the same three, with
dynamic token counts, so a start compiles a handful of graphs (M = 1 and M >= 2 each), not
one per layer or per step; the linears (opaque oneDNN weights) and the attention (paged
cache, host-side metadata) stay eager.

Measured, this loses (docs/performance.md, CPU): a compiled function costs about 20 us more
per call than the eager ops it replaces (dynamo's guards and wrappers), which only larger
prefill chunks (hundreds of tokens) earn back; a decode step calls each 30 times with a few
dozen rows, and a SmolLM2 run got 0.67x. So it is off unless asked for: FLAGSERVE_CPU_COMPILE
is `off` (the default) or `ops`; EngineArgs.enforce_eager keeps it off either way. What would
pay is one graph per step (vLLM's piecewise compile), with the attention and the packed
matmuls as opaque custom ops. Compiled artifacts persist in TORCHINDUCTOR_CACHE_DIR (default
~/.cache/flagserve/inductor): a second start loads them (26 s -> 14 s here). Inductor sums in
another order than eager torch: not bit-exact, within float rounding (tests).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
from torch import nn

from kernels import KernelOps
from kernels.env import COMPILE_ENV, CpuCompile, cache_root, env_choice

log = logging.getLogger(__name__)
COMPILED_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")
CACHE_DIR = cache_root() / "inductor"


def compile_mode(enforce_eager: bool, requested: str | None = None) -> CpuCompile:
    mode = env_choice(COMPILE_ENV, CpuCompile, "off", requested)
    return "off" if enforce_eager else mode


def compiled_ops(ops: KernelOps) -> KernelOps:
    compiled = {name: torch.compile(getattr(ops, name), dynamic=True) for name in COMPILED_OPS}
    # the compiled silu_and_mul runs, not the native linear's fused one
    return dataclasses.replace(ops, name=f"{ops.name}+inductor", packed_silu_and_mul=None,
                               **compiled)


def use_ops(model: nn.Module, old: KernelOps, new: KernelOps) -> None:
    for module in model.modules():
        if getattr(module, "ops", None) is old:
            module.ops = new


def warm_up(ops: KernelOps, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
    """Compile now (or load from the cache): one token and several, as decode and prefill."""
    for rows in (1, 3):
        x = torch.randn(rows, hidden, dtype=dtype)
        weight = torch.ones(hidden, dtype=dtype)
        ops.rms_norm(x, weight, 1e-6)
        ops.fused_add_rms_norm(x, x.clone(), weight, 1e-6)
        ops.silu_and_mul(torch.randn(rows, 2 * intermediate, dtype=dtype))


def compile_cpu_ops(model: nn.Module, ops: KernelOps, hidden: int, intermediate: int,
                    dtype: torch.dtype) -> KernelOps:
    """The model's layers call the compiled ops from now on; returns them. A failed compile
    (no C++ compiler, say) leaves the model eager, with a warning."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    log.info("compiling the elementwise ops for CPU with inductor (cached in %s) ...",
             os.environ["TORCHINDUCTOR_CACHE_DIR"])
    start = time.perf_counter()
    new = compiled_ops(ops)
    try:
        with torch.inference_mode():
            warm_up(new, hidden, intermediate, dtype)
    except Exception as err:  # noqa: BLE001 - compiling is an optimisation: run eager instead
        log.warning("torch.compile failed, running eager (%s: %s)", type(err).__name__, err)
        return ops
    use_ops(model, ops, new)
    log.info("compiled in %.1f s", time.perf_counter() - start)
    return new
