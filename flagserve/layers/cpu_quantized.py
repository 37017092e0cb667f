"""Float32 weights recognised as GGUF Q4_1 or Q8_0 blocks, for the native linear on CPU.

A GGUF checkpoint's quantized weights arrive dequantized to float32 (models/gguf.py), 32 bits
for every 5 (Q4_1) or 8.5 (Q8_0) the file stored. A step of a few rows streams every weight
from memory once, so where a weight's values are exactly those of such blocks the native
kernel reads the blocks and computes each value as gguf's numpy does: the same bits in a
sixth or a quarter of the bytes (kernels/csrc/cpu_gguf_blocks.h). The blocks are found from
the values, whatever the loader did to the rows on the way (q/k un-permuted, q|k|v and
gate|up fused), and every block is checked by recomputing it: a weight with one block that
does not reproduce stays float32.

Per 32 consecutive values of a row a block stores integers q and float16 scales: Q4_1 a value
(d * q) + m with q in [0, 16), Q8_0 d * q with q an int8 (Q4_0's and Q5_0's blocks are Q8_0
ones too). llama.cpp's and gguf's quantizers give a Q4_1 block's smallest value q = 0 and its
largest q = 15, and a Q8_0 block's largest magnitude |q| = 127 (Q4_0's 8, Q5_0's 16), so m is
the block's minimum and d is near (max - m) / 15 or max |v| / 127 (8, 16); a few float16
neighbours of that estimate cover its rounding.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels import cpu_native

BLOCK = 32  # values of a row per block
# d's float16 neighbours tried, in this order, where the estimate rounds to another d
_D_STEPS = (0, -1, 1, -2, 2)
_PART_VALUES = 1 << 22
_PROBE_ROWS = 8  # most weights hold no such values: know it from a few rows


@dataclass(frozen=True)
class _Format:
    low: int  # q's range
    high: int
    # q of the block's largest value (Q4_1) or magnitude (Q8_0, signed: d may be negative),
    # tried in turn
    tops: tuple[int, ...]
    offset: bool  # values are d * q + m (Q4_1), else d * q (Q8_0)
    dtype: torch.dtype  # of q


Q4_1 = _Format(0, 15, (15,), True, torch.uint8)
# Q4_0 and Q5_0 blocks are d * (q - 8) and d * (q - 16), their largest magnitude at
# |q - 8| = 8 and |q - 16| = 16: Q8_0 blocks too, whose d is that magnitude / -8 or / -16
# (negative where the block's extreme value is positive: its q - 8 is -8).
Q8_0 = _Format(-128, 127, (127, -8, 8, -16, 16), False, torch.int8)


def packed_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (float32 [N, K]) packed for the native linear as the Q4_1 (else Q8_0) blocks its
    values are, bit for bit; None where they are neither."""
    if (found := find_blocks(weight, Q4_1)) is not None:
        return cpu_native.pack_linear_weight_q4_1(*found)
    if (found := find_blocks(weight, Q8_0)) is not None:
        return cpu_native.pack_linear_weight_q8_0(*found[:2])
    return None


def find_blocks(weight: torch.Tensor, fmt: _Format, rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K], d [N, K / 32] float16, m [N, K / 32] float16: zero for Q8_0) whose values in
    `fmt` are weight's, bit for bit; None where weight holds other values. Looked at `rows`
    rows at a time (default: ~4M values, so the temporaries stay tens of MB)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    parts = []
    for part in row_parts(weight, rows or max(1, _PART_VALUES // weight.shape[1])):
        found = _blocks(part.reshape(-1, BLOCK), fmt)
        if found is None:
            return None
        parts.append(found)
    q, d, m = (torch.cat(x) for x in zip(*parts))
    n = weight.shape[0]
    return q.view(n, -1), d.view(n, -1), m.view(n, -1)


def row_parts(weight: torch.Tensor, rows: int) -> Iterator[torch.Tensor]:
    """weight's first few rows, then the rest `rows` at a time: a check of its values that
    stops at the first part that fails stops early for most weights."""
    yield weight[:_PROBE_ROWS]
    yield from weight[_PROBE_ROWS:].split(rows)


def all_float16(values: torch.Tensor) -> bool:
    """Whether every float32 value is a float16: it survives the round trip bit for bit (a NaN
    may not)."""
    return torch.equal(values.half().float().view(torch.int32), values.view(torch.int32))


def _blocks(values: torch.Tensor, fmt: _Format
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [B, 32], d [B] and m [B] float16 for blocks of values [B, 32], or None."""
    if fmt.offset:
        m = values.amin(1)
        if not all_float16(m):
            return None  # a minimum that no float16 m holds (or not a number)
        span = values.amax(1) - m
    else:
        m = values.new_zeros(len(values))
        span = values.abs().amax(1)
    d16 = torch.zeros(len(values), dtype=torch.float16)
    q = torch.zeros(values.shape, dtype=fmt.dtype)
    left = torch.arange(len(values))  # blocks not reproduced yet
    for top, step in itertools.product(fmt.tops, _D_STEPS):
        guess = _float16_step((span[left] / top).half(), step)
        levels, ok = _reproduce(values[left], guess, m[left], fmt)
        d16[left[ok]], q[left[ok]] = guess[ok], levels[ok].to(fmt.dtype)
        left = left[~ok]
        if len(left) == 0:
            return q, d16, m.half()
    return None


def _float16_step(d: torch.Tensor, steps: int) -> torch.Tensor:
    """d moved `steps` float16 values away from zero (past the ends: NaN, which never
    reproduces)."""
    if steps == 0:
        return d
    away = torch.where(d < 0, -steps, steps).to(torch.int16)
    return (d.view(torch.int16) + away).view(torch.float16)


def _reproduce(values: torch.Tensor, d16: torch.Tensor, m: torch.Tensor, fmt: _Format
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, ok): the levels nearest each value for d16 and m, and which blocks they reproduce."""
    d = d16.float()[:, None]
    zero = d == 0
    q = ((values - m[:, None]) / torch.where(zero, 1.0, d)).round().clamp(fmt.low, fmt.high)
    # As the integers stored: no -0.0 (a value -0.0 is d * 0 only for a negative d)
    q = torch.where(zero, 0.0, q).to(fmt.dtype).float()
    again = d * q  # exact in float32 (11 significant bits times at most 8)
    if fmt.offset:
        again = again + m[:, None]  # rounded once, as gguf's numpy and the kernel
    same = (again.view(torch.int32) == values.view(torch.int32)).all(1)
    return q, same & torch.isfinite(d[:, 0])
