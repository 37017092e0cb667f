"""Packed weights for the linear layers and the LM head on CPU (issue 16).

`F.linear` on CPU calls MKL's sgemm with the weight as stored ([out, in]), and MKL re-blocks
it on every call; for the small row counts of decoding that costs more than the math (on
SmolLM2's LM head, [49152, 576], 8 rows take 3-4x as long as one). So the engine packs every
weight once, at load, into a layout its kernel reads as it is:

- `native` (float32): FlagServe's own kernel (kernels/csrc/cpu_linear.cpp), tiles of 32
  output columns (16 with AVX2) each stored as one stream: faster than oneDNN on the few
  rows of a decode step, where oneDNN left memory bandwidth unused, and on par at hundreds
  of rows (docs/performance.md, CPU).
- `onednn`: oneDNN's blocked layout (`_reorder_linear_weight`) and `_linear_pointwise`; the
  same kernels use AMX and AVX512-BF16 for bfloat16, which the native kernel does not do.

Either way the outputs are the same sums in another order: float32 results differ from
F.linear's by rounding only (about 1e-6 relative).

Two kinds of float32 weight are stored in fewer bytes for the native kernel, which widens
them exactly as it reads them, so the outputs are the same bits, and a step of a few rows,
which streams every weight from memory once, reads fewer bytes (FLAGSERVE_CPU_WEIGHTS=auto,
the default; `float32` keeps every weight in float32):
- values that are all bfloat16 (a bf16 checkpoint run in float32): packed in bfloat16, half
  the bytes (faster up to tens of rows, a little slower at hundreds, where the widening
  competes with the FMAs: docs/performance.md, CPU); all float16 (an fp16 checkpoint, a GGUF
  file's F16 tensors): packed in float16 likewise;
- values that are a GGUF file's Q4_1 or Q8_0 blocks (cpu_quantized.py): packed as those
  blocks too, a sixth or a quarter of the bytes, for steps of up to FEW_ROWS rows; more rows
  read the float32 packing, as widening the blocks costs a prefill more than it saves.

CpuMatmul modes (FLAGSERVE_CPU_MATMUL, default auto): `aten` is F.linear everywhere; `native`
and `onednn` pack every linear layer and the LM head; `auto` is native for float32 where the
native CPU kernels build, else onednn where torch has oneDNN (mkldnn) and the dtype is
float32, or bfloat16 on a CPU with oneDNN's bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT: an
AVX2-only CPU has none), else aten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flagserve.layers.cpu_quantized import all_float16, packed_blocks, row_parts
from kernels import cpu_native
from kernels.env import MATMUL_ENV, WEIGHTS_ENV, CpuMatmul, CpuWeights, env_choice

# oneDNN picks its blocking for the row count it is told to expect; decode batches and the
# LM head's sampled rows are in the tens (measured: docs/performance.md, CPU).
BATCH_HINT = 64
# Steps of up to this many rows read a GGUF block packing where a weight has one: faster than
# float32 up to about a hundred rows, slower at a prefill's thousands (docs/performance.md, CPU).
FEW_ROWS = 64


def matmul_mode(device: torch.device, dtype: torch.dtype, requested: str | None = None) -> CpuMatmul:
    """`aten` or `onednn` for a model on `device` in `dtype`; `requested` defaults to the
    environment's FLAGSERVE_CPU_MATMUL."""
    mode = env_choice(MATMUL_ENV, CpuMatmul, "auto", requested)
    cpu = device.type == "cpu"
    cpu_float32 = cpu and dtype == torch.float32
    onednn = cpu and torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_supported()))
    if mode == "auto":
        if cpu_float32 and cpu_native.available():
            return "native"
        return "onednn" if onednn else "aten"
    if mode == "onednn" and not onednn:
        raise ValueError(f"{MATMUL_ENV}=onednn needs a CPU model in float32, or bfloat16 on a "
                         f"CPU with oneDNN's bf16 path, and torch built with oneDNN "
                         f"(device {device}, dtype {dtype})")
    if mode == "native" and not (cpu_float32 and cpu_native.available("native")):
        raise ValueError(f"{MATMUL_ENV}=native needs a CPU model in float32 "
                         f"(device {device}, dtype {dtype})")
    return mode


def bf16_supported() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (packing raises where it cannot)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # noqa: SLF001 - torch's own check


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in the layout of `mode`'s kernel; called as F.linear(x, weight, bias)."""
    mode: Literal["native", "onednn"]
    # native: [ceil(out / 32), in, 32], float32, or bfloat16 / float16 where every value is
    # one; onednn: an opaque mkldnn tensor
    data: torch.Tensor
    out_features: int
    # native: the same weight as GGUF blocks (cpu_quantized.py), which steps of up to FEW_ROWS
    # rows read instead of data; None where its values are no such blocks
    few: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.mode == "onednn":
            return torch.ops.mkldnn._linear_pointwise(  # noqa: SLF001 - torch's op (inductor's too)
                x, self.data, bias, "none", [], "")
        return self._native(cpu_native.packed_linear, x, bias, self.out_features)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None, kernel) -> torch.Tensor:
        """silu_and_mul of self(x, bias) for a native [gate; up] weight, by `kernel`
        (KernelOps.packed_silu_and_mul) in one pass."""
        return self._native(kernel, x, bias, self.out_features // 2)

    def for_rows(self, rows: int) -> torch.Tensor:
        """The native packing a step of `rows` rows reads."""
        return self.few if self.few is not None and rows <= FEW_ROWS else self.data

    def _native(self, kernel, x: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = kernel(rows, self.for_rows(rows.shape[0]), self.out_features, bias)
        return out.view(*x.shape[:-1], width)


def pack_weight(weight: torch.Tensor, mode: Literal["native", "onednn"]) -> PackedWeight:
    weight = weight.detach().contiguous()
    if mode == "onednn":
        return PackedWeight(mode, torch.ops.mkldnn._reorder_linear_weight(  # noqa: SLF001
            weight, BATCH_HINT), weight.shape[0])
    few = None
    if env_choice(WEIGHTS_ENV, CpuWeights, "auto") == "auto":
        if holds_bfloat16(weight):
            weight = weight.to(torch.bfloat16)  # exact: every value is one
        elif holds_float16(weight):
            weight = weight.to(torch.float16)  # exact likewise
        else:
            few = packed_blocks(weight)
    return PackedWeight(mode, cpu_native.pack_linear_weight(weight), weight.shape[0], few)


def holds_bfloat16(weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether every value of a float32 weight is a bfloat16 (the low 16 bits of each are
    zero), looked at `rows` rows at a time."""
    return _every_part(weight, rows, lambda part: not (part.view(torch.int32) & 0xFFFF).any())


def holds_float16(weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether every value of a float32 weight is a float16 (it survives the round trip bit
    for bit), looked at `rows` rows at a time."""
    return _every_part(weight, rows, all_float16)


def _every_part(weight: torch.Tensor, rows: int, check) -> bool:
    """Whether `check` holds for every part of a float32 weight's rows
    (cpu_quantized.row_parts)."""
    if weight.dtype != torch.float32:
        return False
    return all(check(part) for part in row_parts(weight.reshape(weight.shape[0], -1), rows))
