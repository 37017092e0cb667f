"""oneDNN's prepacked matmul for the linear layers and the LM head on CPU (issue 16).

`F.linear` on CPU calls MKL's sgemm with the weight as stored ([out, in]), and MKL re-blocks
it on every call; for the small row counts of decoding that costs more than the math (on
SmolLM2's LM head, [49152, 576], 8 rows take 3-4x as long as one). oneDNN can reorder the
weight once, at load, into the blocked layout its kernels read (`_reorder_linear_weight`),
and `_linear_pointwise` then multiplies against it; the same kernels use AMX and
AVX512-BF16 for bfloat16. The result is the same sums in another order: float32 outputs
differ from F.linear's by rounding only (about 1e-6 relative).

CpuMatmul modes (FLAGSERVE_CPU_MATMUL, default auto): `aten` is F.linear everywhere;
`onednn` packs every linear layer and the LM head; `auto` is onednn on a CPU where torch
has oneDNN (mkldnn) and the dtype is float32, or bfloat16 on a CPU with oneDNN's bf16 path
(AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has none), else aten.
"""
from __future__ import annotations

import os
from typing import Literal, get_args

import torch

CpuMatmul = Literal["auto", "aten", "onednn"]
MATMUL_ENV = "FLAGSERVE_CPU_MATMUL"
# oneDNN picks its blocking for the row count it is told to expect; decode batches and the
# LM head's sampled rows are in the tens (measured: docs/performance.md, CPU).
BATCH_HINT = 64


def matmul_mode(device: torch.device, dtype: torch.dtype, requested: str | None = None) -> CpuMatmul:
    """`aten` or `onednn` for a model on `device` in `dtype`; `requested` defaults to the
    environment's FLAGSERVE_CPU_MATMUL."""
    mode = requested if requested is not None else os.environ.get(MATMUL_ENV, "auto")
    if mode not in get_args(CpuMatmul):
        raise ValueError(f"{MATMUL_ENV} must be one of {get_args(CpuMatmul)}, got {mode!r}")
    usable = device.type == "cpu" and torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_supported()))
    if mode == "auto":
        return "onednn" if usable else "aten"
    if mode == "onednn" and not usable:
        raise ValueError(f"{MATMUL_ENV}=onednn needs a CPU model in float32, or bfloat16 on a "
                         f"CPU with oneDNN's bf16 path, and torch built with oneDNN "
                         f"(device {device}, dtype {dtype})")
    return mode


def bf16_supported() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (packing raises where it cannot)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # noqa: SLF001 - torch's own check


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(  # noqa: SLF001 - torch's op (inductor's too)
        weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) against pack_weight(weight); x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: SLF001
