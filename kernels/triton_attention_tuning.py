"""Launch settings of the Triton attention kernels, in one place to retune on a GPU.

They were written from the register and shared-memory budgets of an H100 (sm_90: 64K 32-bit
registers and 228 KB shared memory per SM, at most 255 registers per thread), the way
FlashAttention-style Triton kernels size their tiles, and changed where a GPU measured better
(each entry's comment says which). Every entry compiles for sm_90 without register spills
unless it is marked as measured with them (tests/kernels/sm90_compile.py checks).
benchmarks/attention.py prints both decode paths and prefill per head_dim against SDPA, which
is what a retune needs; FLAGSERVE_TRITON_AUTOTUNE=1 lets triton.autotune pick prefill tiles
on CUDA instead (keyed on head_dim, GQA group, dtype and a token-count bucket).
"""
from dataclasses import dataclass, field

import torch

from kernels.backend import interpreter_enabled
from kernels.env import env_flag

AUTOTUNE_ENV = "FLAGSERVE_TRITON_AUTOTUNE"


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per program (prefill); decode pads its GQA group to 16 rows
    block_n: int  # cached positions per inner-loop step
    num_warps: int
    num_stages: int  # K/V tiles in flight (software pipelining through shared memory)
    # Compiles for sm_90 with register spills, kept because it measured faster than the
    # spill-free tiles (tests/kernels/sm90_compile.py allows its spills, no others').
    spills: bool = field(default=False, compare=False)  # a note on the tile, not its identity
    # Prefill: rescale the accumulator only when a row's max grew by more than 2**8
    # (triton_paged_attend.py). Not in the table until a GPU measures it faster (the sweep
    # times every tile both ways).
    lazy_rescale: bool = False


# Decode is bandwidth-bound with only 16 (padded) query rows: registers and shared memory go
# to K/V tiles. 64 x 128 16-bit tiles with 2 stages (K+V: 64 KB) leave room for 3 programs
# per SM, the setting that measured 88-91% of HBM peak at large batch x context. head_dim 64
# has half the bytes per stage, so a third stage keeps the bytes in flight (and avoids a
# ptxas spill its 2-stage single pass shows); 256 halves BLOCK_N to keep the footprint.
DECODE_TILES = {64: Tile(16, 64, 4, 3), 128: Tile(16, 64, 4, 2), 256: Tile(16, 32, 4, 2)}
DECODE_TILE_FP32 = Tile(16, 16, 4, 2)  # IEEE FMA dots: registers, not bandwidth, bind

# Prefill is compute-bound: BLOCK_M x head_dim of fp32 accumulator, the q tile and the
# BLOCK_M x BLOCK_N scores live in registers through the KV loop. Written from register budgets
# first (8 warps, 64-key tiles, 3 stages, no spills); then measured on an H200
# (benchmarks/attention.py with FLAGSERVE_TRITON_AUTOTUNE=1, docs/performance.md "GPU"):
# 32-key tiles over 4 warps and 2 stages beat them by 1.15-1.25x at head_dim 128 and 2x at
# 256, despite 64-120 bytes of spills; at 64 the table's entry stayed as fast or faster. A
# later sweep of every tile (BLOCK_M too) kept 128's and moved 256 to 128 rows x 64 keys over
# 8 warps (1.03-1.12x the 64 x 32 x 4-warp tile, 72 bytes of spills).
PREFILL_TILES = {64: Tile(128, 64, 8, 3), 128: Tile(128, 32, 4, 2, spills=True),
                 256: Tile(128, 64, 8, 2, spills=True)}
PREFILL_TILE_FP32 = Tile(32, 16, 8, 2)  # IEEE FMA dots need far more registers

# Whole prompts over their own K/V rows (triton_prefill_attention.prefill_attention_triton),
# K/V tiles through tensor descriptors (TMA): the head_dims here (on sm_90+, 16-bit); the
# others load through pointers with the paged table's tile. Measured on an H200
# (docs/performance.md, GPU, 2026-11-28): descriptors 1-4% faster than pointers at 128 and
# 256 and 2-4% slower at 64; at 128, 64-key tiles 1.17x the paged table's 32 (geometric mean
# over 32 x 512 and 4 x 4,096 tokens; 128 bytes of spills); 256 kept the paged entry. Triton
# 3.6's warp specialisation of the key loop failed to compile at 4 warps and gained nothing
# at 8 (the same sweep).
OWN_ROWS_TMA_TILES = {128: Tile(128, 64, 4, 2, spills=True), 256: PREFILL_TILES[256]}


def _head_dim_class(block_d: int) -> int:
    """Table key of a (power-of-two padded) head_dim: <= 64, <= 128, larger."""
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def decode_tile(block_d: int, dtype: torch.dtype) -> Tile:
    return DECODE_TILE_FP32 if dtype == torch.float32 else DECODE_TILES[_head_dim_class(block_d)]


def prefill_tile(block_d: int, dtype: torch.dtype) -> Tile:
    return PREFILL_TILE_FP32 if dtype == torch.float32 else PREFILL_TILES[_head_dim_class(block_d)]


def own_rows_tile(block_d: int, dtype: torch.dtype, descriptor: bool) -> Tile:
    if descriptor and dtype != torch.float32 and block_d in OWN_ROWS_TMA_TILES:
        return OWN_ROWS_TMA_TILES[block_d]
    return prefill_tile(block_d, dtype)


def autotune_enabled(device: torch.device) -> bool:
    """Only compiled CUDA kernels autotune: the interpreter would time numpy."""
    return device.type == "cuda" and not interpreter_enabled() and env_flag(AUTOTUNE_ENV)


def prefill_autotune_space(block_d: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, num_warps, num_stages) candidates around the table entry. BLOCK_M is not
    tuned: it fixes the query tiling the host builds its prefix sums from."""
    block_ns = (32, 64) if block_d > 128 else (32, 64, 128)
    return [(n, w, s) for n in block_ns for w in (4, 8) for s in (2, 3, 4)
            if not (n == 128 and s == 4)]  # 4 x 2 x 128 x 128 x 2 B > 228 KB of shared memory


def decode_sweep_space(block_d: int, dtype: torch.dtype) -> list[Tile]:
    """Decode tiles around the table entry, for benchmarks/attention.py --sweep-tiles (what a
    GPU session measures to retune DECODE_TILES): BLOCK_N x warps x stages whose K/V stages
    fit in shared memory with room for a second program per SM."""
    if dtype == torch.float32:
        return [DECODE_TILE_FP32]
    elem = torch.empty((), dtype=dtype).element_size()
    return [Tile(16, n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)
            if 2 * n * block_d * elem * s <= 112 * 1024]


def prefill_sweep_space(block_d: int, dtype: torch.dtype, own_rows: bool = False) -> list[Tile]:
    """Prefill tiles for benchmarks/attention.py --sweep-tiles, BLOCK_M included (autotune
    cannot vary it): rows x keys x warps x stages whose K/V stages fit in shared memory; the
    paged kernel's with and without the lazy rescale, own rows' without (it measured slower
    there at every best tile)."""
    if dtype == torch.float32:
        return [PREFILL_TILE_FP32]
    elem = torch.empty((), dtype=dtype).element_size()
    return [Tile(m, n, w, s, lazy_rescale=lazy) for m in (64, 128) for n in (32, 64, 128)
            for w in (4, 8) for s in (2, 3) for lazy in ((False,) if own_rows else (False, True))
            if 2 * n * block_d * elem * s + m * block_d * elem <= 200 * 1024]


def token_bucket(num_tokens: int) -> int:
    """Autotune key for the batch's size: powers of two from 256 to 16384 tokens."""
    return min(16384, max(256, 1 << max(0, num_tokens - 1).bit_length()))
