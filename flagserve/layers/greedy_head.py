"""The LM head of an all-greedy step on CPU: the float32 argmax without the float32 logits
(issue 16).

Every logit is approximated within a bound, and only the tokens that could be the maximum
are recomputed in float32 (kernels/csrc/cpu_greedy_head.cpp has the bound and why the token
is the float32 argmax's, not an approximation). Two approximations, one interface (Approx):
- int8 (`Int8Logits`, kernels/csrc/cpu_int8_logits.cpp): int8 weights, int16 inputs, exact
  int32 sums by AVX512-VNNI; a quarter of float32's bytes and twice its products per
  instruction;
- bf16 (`Bf16Logits`): oneDNN's bfloat16 matmul, fast where AMX multiplies it; without AMX,
  AVX512-BF16's dot product makes half as many products per cycle as float32 FMAs
  (docs/performance.md, CPU).
For an LM head packed for the native float32 kernel, on one tensor-parallel rank.
FLAGSERVE_CPU_GREEDY_HEAD:
- auto (default): bf16 with AMX, else int8 with AVX512-VNNI, in every greedy step; only for
  heads of AUTO_MIN_WEIGHTS weights or more (a smaller head stays in cache, where the float32
  kernel is as fast); else none;
- bf16 | int8: that approximation wherever the native kernels run (tests; bf16 by oneDNN or
  else by F.linear, int8 by a portable loop without AVX512-VNNI);
- off: every step computes its float32 logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from flagserve.layers.cpu_matmul import PackedWeight, bf16_supported, pack_weight
from kernels import cpu_native
from kernels.env import GREEDY_HEAD_ENV, Approximation, GreedyHeadMode, env_choice
from kernels.sampling import apply_token_bitmask_torch

AUTO_MIN_WEIGHTS = 16 << 20  # SmolLM2's head: 28M


def greedy_head_mode() -> GreedyHeadMode:
    return env_choice(GREEDY_HEAD_ENV, GreedyHeadMode, "auto")


def auto_approximation() -> Approximation | None:
    """The approximation that beats the float32 head on this CPU, if one does: bf16 where AMX
    multiplies it, int8 where AVX512-VNNI sums it."""
    flags = set(cpu_native.cpu_flags().split())
    if "amx_bf16" in flags and bf16_supported():
        return "bf16"
    return "int8" if {"avx512_vnni", "avx512bw"} <= flags else None


class Approx(Protocol):
    """Approximate logits of an LM head [V, K] and what the bound needs beyond the bf16 one."""
    eta_norms: torch.Tensor | None  # int8: |w_v - s_v q_v| per token

    def __call__(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bfloat16 [M, >= n] logits of float32 x [M, K], int8: each row's |eps|)."""


class Bf16Logits:
    eta_norms = None

    def __init__(self, weight: torch.Tensor):
        bf16 = weight.to(torch.bfloat16)
        packed: PackedWeight | None = pack_weight(bf16, "onednn") if bf16_supported() else None
        self._matmul = (lambda x: packed(x, None)) if packed else (lambda x: F.linear(x, bf16))

    def __call__(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, None]:
        return self._matmul(x.to(torch.bfloat16)), None


class Int8Logits:
    def __init__(self, weight: torch.Tensor):
        self._packed, self._scales, self.eta_norms = cpu_native.pack_int8_rows(weight)

    def __call__(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_native.int8_logits(x, self._packed, self._scales, n)


APPROXIMATIONS: dict[Approximation, type[Bf16Logits] | type[Int8Logits]] = {
    "bf16": Bf16Logits, "int8": Int8Logits}


@dataclass(frozen=True)
class GreedyHead:
    weight: torch.Tensor  # the LM head's float32 [V, K], rows contiguous: the exact recompute
    approx: Approx
    norms: torch.Tensor  # [vocab] float32: each row's L2 norm, rounded up
    max_norm: float

    @classmethod
    def build(cls, weight: torch.Tensor, vocab_size: int, kind: Approximation) -> GreedyHead:
        weight = weight.detach().contiguous()
        norms = weight[:vocab_size].double().norm(dim=1) * (1 + 1e-6)
        return cls(weight, APPROXIMATIONS[kind](weight), norms.float(), float(norms.max()))

    def __call__(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """[M] int64: the argmax of each row's float32 logits, among the tokens its row of
        `bitmask` allows (a grammar's); -1 where a logit is not finite or the row allows no
        token (the caller computes that row's logits)."""
        x = hidden.float().contiguous()
        n = self.norms.numel()  # the vocabulary (a padded head has more rows)
        approx, x_err = self.approx(x, n)
        if bitmask is not None:
            # A token outside the grammar gets bf16's lowest finite value: below the bound of
            # any allowed token, so never a candidate (-inf would read as an overflow).
            outside = apply_token_bitmask_torch(approx.new_zeros(1, n, dtype=torch.float32), bitmask)
            approx = torch.where(outside == 0, approx[:, :n], torch.finfo(torch.bfloat16).min)
        tokens = cpu_native.greedy_lm_head(x, self.weight, approx, self.norms, self.max_norm,
                                           self.approx.eta_norms, x_err)
        if bitmask is not None:
            tokens[(bitmask == 0).all(-1)] = -1
        return tokens


def greedy_head_for(weight: torch.Tensor, vocab_size: int, matmul: str,
                    tp_size: int) -> GreedyHead | None:
    """A GreedyHead for an LM head packed for the `matmul` kernel, where it pays (module
    docstring)."""
    mode = greedy_head_mode()
    if matmul != "native" or tp_size != 1 or weight.dtype != torch.float32:
        if mode in ("off", "auto"):
            return None
        # asked for by name: refused, not dropped without a word
        raise ValueError(f"{GREEDY_HEAD_ENV}={mode} needs the native float32 matmul with TP 1 "
                         f"(this LM head: {matmul} matmul, {str(weight.dtype).removeprefix('torch.')}"
                         f", TP {tp_size}); set it to auto or off")
    if mode == "auto":
        kind = auto_approximation() if weight.numel() >= AUTO_MIN_WEIGHTS else None
        return None if kind is None else GreedyHead.build(weight, vocab_size, kind)
    return None if mode == "off" else GreedyHead.build(weight, vocab_size, mode)
