"""What a model on CPU gets after loading (issue 16): its linear layers and LM head packed
for the native matmul or oneDNN (layers/cpu_matmul.py; FLAGSERVE_CPU_MATMUL), native kernels
for the attention over the paged cache and the elementwise ops (kernels/cpu_native.py;
FLAGSERVE_CPU_KERNELS), and, when asked for (FLAGSERVE_CPU_COMPILE=ops, off by default: it
measured slower), its elementwise ops compiled by inductor (cpu_compile.py). GPU models are
left alone."""
from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from torch import nn

from flagserve.engine.cpu_compile import compile_cpu_ops, compile_mode, use_ops
from flagserve.layers.cpu_matmul import matmul_mode
from kernels import KernelOps
from kernels.cpu_native import available as native_kernels_available
from kernels.cpu_native import native_ops

log = logging.getLogger(__name__)


def pack_linear_weights(model: nn.Module, mode: Literal["native", "onednn"]) -> int:
    """Every layer that can multiply by a packed weight does from now on; returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "pack_for_cpu")]
    for layer in layers:
        layer.pack_for_cpu(mode)
    return len(layers)


def use_native_kernels(model: nn.Module, ops: KernelOps) -> KernelOps:
    """The model's layers run the native CPU kernels from now on, where they build (the
    torch reference otherwise); returns the ops the model now uses."""
    if ops.name != "torch" or not native_kernels_available():
        return ops
    new = native_ops(ops)
    use_ops(model, ops, new)
    return new


def prepare_cpu_model(model: nn.Module, device: torch.device, dtype: torch.dtype,
                      ops: KernelOps, enforce_eager: bool = True) -> KernelOps:
    """Returns the ops the model runs from now on."""
    if device.type != "cpu":
        return ops
    if (mode := matmul_mode(device, dtype)) != "aten":
        start = time.perf_counter()
        count = pack_linear_weights(model, mode)
        log.info("packed %d weights for the %s matmul in %.2f s", count, mode,
                 time.perf_counter() - start)
    ops = use_native_kernels(model, ops)
    if compile_mode(enforce_eager) == "ops":
        cfg = model.config
        ops = compile_cpu_ops(model, ops, cfg.hidden_size, cfg.intermediate_size, dtype)
    return ops
