"""A float32 weight recognised as GGUF Q4_1 blocks, for the native linear kernel on CPU.

A GGUF checkpoint's quantized weights arrive dequantized to float32 (models/gguf.py), 32 bits
for every 5 the file stored. A step of a few rows streams every weight from memory once, so
where a weight's values are exactly those of Q4_1 blocks the native kernel can read the blocks
and compute each value as gguf's numpy does: the same bits at a sixth of the bytes
(kernels/csrc/cpu_linear.cpp). The blocks are found from the values, whatever the loader did
to the rows on the way (q/k un-permuted, q|k|v and gate|up fused), and every one is checked
by recomputing it: a weight with one block that does not reproduce stays float32.

Q4_1 stores, per 32 consecutive values of a row, q in [0, 16) and float16 d and m; a value is
(d * q, rounded to float32) + m, rounded. llama.cpp's and gguf's quantizers give the block's
smallest value q = 0 and its largest q = 15, so m is the block's minimum and d is near
(max - m) / 15; a few float16 neighbours of that cover its rounding.
"""
from __future__ import annotations

import torch

BLOCK = 32  # values of a row per Q4_1 block
LEVELS = 15  # the largest q
# d's float16 neighbours tried, in this order, where (max - m) / 15 rounds to another d
_D_STEPS = (0, -1, 1, -2, 2)


def q4_1_blocks(weight: torch.Tensor, rows: int = 4096
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K] uint8, d [N, K / 32] float16, m [N, K / 32] float16) whose Q4_1 values are
    weight's, bit for bit; None where weight (float32 [N, K]) holds other values."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    parts = []
    for part in weight.split(rows):
        found = _blocks(part.reshape(-1, BLOCK))
        if found is None:
            return None
        parts.append(found)
    q, d, m = (torch.cat(x) for x in zip(*parts))
    n = weight.shape[0]
    return q.view(n, -1), d.view(n, -1), m.view(n, -1)


def _blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [B, 32] uint8, d [B] and m [B] float16 for blocks of values [B, 32], or None."""
    m = values.amin(1)
    m16 = m.half()
    if not torch.equal(m16.float().view(torch.int32), m.view(torch.int32)):
        return None  # a minimum that no float16 m holds (or not a number)
    estimate = ((values.amax(1) - m) / LEVELS).half()
    d16 = torch.zeros_like(m16)
    q = torch.zeros(values.shape, dtype=torch.uint8)
    left = torch.arange(len(values))  # blocks not reproduced yet
    for step in _D_STEPS:
        guess = _float16_step(estimate[left], step)
        levels, ok = _reproduce(values[left], guess, m[left])
        d16[left[ok]], q[left[ok]] = guess[ok], levels[ok]
        left = left[~ok]
        if len(left) == 0:
            return q, d16, m16
    return None


def _float16_step(d: torch.Tensor, steps: int) -> torch.Tensor:
    """d moved `steps` float16 values up (the positive ones: d >= 0)."""
    if steps == 0:
        return d
    return (d.view(torch.int16) + steps).clamp(min=0).view(torch.float16)


def _reproduce(values: torch.Tensor, d16: torch.Tensor, m: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, ok): the levels nearest each value for d16 and m, and which blocks they reproduce."""
    d = d16.float()[:, None]
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((values - m[:, None]) / safe).round().clamp(0, LEVELS)
    q = torch.where(d == 0, torch.zeros_like(q), q)
    product = d * q  # two operations, two roundings, as gguf's numpy and the kernel
    again = product + m[:, None]
    same = (again.view(torch.int32) == values.view(torch.int32)).all(1)
    return q.to(torch.uint8), same & torch.isfinite(d[:, 0])
