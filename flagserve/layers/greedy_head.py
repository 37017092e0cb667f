"""The LM head of an all-greedy step on CPU: the float32 argmax without the float32 logits
(issue 16).

oneDNN's bfloat16 matmul bounds every logit, and only the tokens that could be the maximum
are recomputed in float32 (kernels/csrc/cpu_greedy_head.cpp has the bound and why the token
is the float32 argmax's, not an approximation). For an LM head packed for the native
float32 kernel, on one tensor-parallel rank. FLAGSERVE_CPU_GREEDY_HEAD:
- auto (default): where the CPU multiplies bfloat16 in hardware and it was measured faster
  (docs/performance.md, CPU): with AMX in every greedy step; with AVX512-BF16 alone in steps
  of up to AVX512_BF16_MAX_ROWS rows (beyond, oneDNN's bf16 matmul there is slower than the
  float32 kernel) and only for a head the float32 kernel reads in float32 (one it reads in
  fewer bytes, exactly: bf16 values stored in bf16, GGUF Q8_0 blocks as blocks, by
  cpu_matmul.py, was faster); and only for heads of AUTO_MIN_WEIGHTS weights or more (a
  smaller head stays in cache, where the float32 kernel is as fast). Emulated bfloat16 is
  slower still;
- on: wherever the native kernels run (tests), bfloat16 by oneDNN or else by F.linear;
- off: every step computes its float32 logits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from flagserve.layers.cpu_matmul import PackedWeight, bf16_supported, pack_weight
from kernels import cpu_native
from kernels.env import env_choice
from kernels.sampling import apply_token_bitmask_torch

GreedyHeadMode = Literal["auto", "on", "off"]
GREEDY_HEAD_ENV = "FLAGSERVE_CPU_GREEDY_HEAD"
AVX512_BF16_MAX_ROWS = 16
AUTO_MIN_WEIGHTS = 16 << 20  # SmolLM2's head: 28M


def greedy_head_mode() -> GreedyHeadMode:
    return env_choice(GREEDY_HEAD_ENV, GreedyHeadMode, "auto")


def bf16_hardware() -> Literal["amx", "avx512_bf16"] | None:
    """How this CPU multiplies bfloat16 where oneDNN uses it: in tiles (AMX), in vectors
    (AVX512-BF16), or not in hardware (None)."""
    flags = set(cpu_native.cpu_flags().split())
    if not bf16_supported():
        return None
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else None


def bf16_matmul(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    if not bf16_supported():
        return lambda x: F.linear(x, weight)
    packed: PackedWeight = pack_weight(weight, "onednn")
    return lambda x: packed(x, None)


@dataclass(frozen=True)
class GreedyHead:
    weight: torch.Tensor  # the LM head's float32 [V, K], rows contiguous: the exact recompute
    approx: Callable[[torch.Tensor], torch.Tensor]  # bfloat16 x [M, K] -> x @ weight.T in bfloat16
    norms: torch.Tensor  # [vocab] float32: each row's L2 norm, rounded up
    max_norm: float
    max_rows: int | None = None  # the most rows it pays for (None: any)

    @classmethod
    def build(cls, weight: torch.Tensor, vocab_size: int, max_rows: int | None = None) -> GreedyHead:
        weight = weight.detach().contiguous()
        norms = weight[:vocab_size].double().norm(dim=1) * (1 + 1e-6)
        return cls(weight, bf16_matmul(weight.to(torch.bfloat16)), norms.float(), float(norms.max()),
                   max_rows)

    def takes(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def __call__(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """[M] int64: the argmax of each row's float32 logits, among the tokens its row of
        `bitmask` allows (a grammar's); -1 where a logit is not finite or the row allows no
        token (the caller computes that row's logits)."""
        x = hidden.float().contiguous()
        approx = self.approx(x.to(torch.bfloat16))
        if bitmask is not None:
            # A token outside the grammar gets bf16's lowest finite value: below the bound of
            # any allowed token, so never a candidate (-inf would read as an overflow).
            n = self.norms.numel()  # the vocabulary, which the mask covers
            outside = apply_token_bitmask_torch(approx.new_zeros(1, n, dtype=torch.float32), bitmask)
            approx = torch.where(outside == 0, approx[:, :n], torch.finfo(torch.bfloat16).min)
        tokens = cpu_native.greedy_lm_head(x, self.weight, approx, self.norms, self.max_norm)
        if bitmask is not None:
            tokens[(bitmask == 0).all(-1)] = -1
        return tokens


def greedy_head_for(weight: torch.Tensor, vocab_size: int, matmul: str, tp_size: int,
                    compact: bool = False) -> GreedyHead | None:
    """A GreedyHead for an LM head packed for the `matmul` kernel (`compact`: a packing the
    float32 kernel reads in bf16's bytes or fewer), where it pays (module docstring)."""
    if matmul != "native" or tp_size != 1 or weight.dtype != torch.float32:
        return None
    mode = greedy_head_mode()
    if mode == "on":
        return GreedyHead.build(weight, vocab_size)
    hardware = bf16_hardware() if mode == "auto" and weight.numel() >= AUTO_MIN_WEIGHTS else None
    if hardware is None or (hardware == "avx512_bf16" and compact):
        return None
    return GreedyHead.build(weight, vocab_size, None if hardware == "amx" else AVX512_BF16_MAX_ROWS)
