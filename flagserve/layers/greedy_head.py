"""The LM head of an all-greedy step on CPU: the float32 argmax without the float32 logits
(issue 16).

oneDNN's bfloat16 matmul bounds every logit, and only the tokens that could be the maximum
are recomputed in float32 (kernels/csrc/cpu_greedy_head.cpp has the bound and why the token
is the float32 argmax's, not an approximation). For an LM head packed for the native
float32 kernel, on one tensor-parallel rank. FLAGSERVE_CPU_GREEDY_HEAD:
- auto (default): where the CPU has AMX, where it was measured faster (docs/performance.md);
  with AVX512-BF16 alone oneDNN's bf16 matmul was slower than the float32 kernel from 32 rows
  on, and emulated bfloat16 is slower still;
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

GreedyHeadMode = Literal["auto", "on", "off"]
GREEDY_HEAD_ENV = "FLAGSERVE_CPU_GREEDY_HEAD"


def greedy_head_mode() -> GreedyHeadMode:
    return env_choice(GREEDY_HEAD_ENV, GreedyHeadMode, "auto")


def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 tiles (AMX), and oneDNN uses it."""
    return "amx_bf16" in cpu_native.cpu_flags().split() and bf16_supported()


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

    @classmethod
    def build(cls, weight: torch.Tensor, vocab_size: int) -> GreedyHead:
        weight = weight.detach().contiguous()
        norms = weight[:vocab_size].double().norm(dim=1) * (1 + 1e-6)
        return cls(weight, bf16_matmul(weight.to(torch.bfloat16)), norms.float(), float(norms.max()))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M] int64: the argmax of each row's float32 logits; -1 where a logit is not finite
        (the caller computes that row's logits)."""
        x = hidden.float().contiguous()
        approx = self.approx(x.to(torch.bfloat16))
        return cpu_native.greedy_lm_head(x, self.weight, approx, self.norms, self.max_norm)


def greedy_head_for(weight: torch.Tensor, vocab_size: int, matmul: str, tp_size: int) -> GreedyHead | None:
    """A GreedyHead for an LM head packed for the `matmul` kernel, where it pays (module
    docstring)."""
    if matmul != "native" or tp_size != 1 or weight.dtype != torch.float32:
        return None
    mode = greedy_head_mode()
    if mode == "off" or (mode == "auto" and not amx_bf16()):
        return None
    return GreedyHead.build(weight, vocab_size)
