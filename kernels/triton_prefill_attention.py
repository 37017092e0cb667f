"""Triton prefill / extend attention over the paged cache (causal, varlen, GQA, online softmax).

Grid (kv_head, query tile): the KV heads of one tile run side by side and read each cached
token's K/V rows (the heads are adjacent in memory) together (an H100 measured 2-6% faster
than tiles first; past CUDA's 65,535 on the grid's second axis the order flips). A tile packs
TILE_TOKENS consecutive new tokens of one sequence times all GROUP query heads of one KV head
into the BLOCK_M rows of the matmul (row r is token r // GROUP, head r % GROUP), so K/V tiles
are shared by the whole GQA group and short chunks (even single decode tokens in a mixed
batch) still fill the rows. Tiles are numbered
across the batch by a prefix sum of each sequence's tile count that every program computes
from cu_seqlens_q itself (a few hundred int32 loads, cached): a program finds its sequence by
counting prefix entries <= its id, so there is no device->host sync, no per-batch
recompilation and no metadata op of its own per layer.

Causal block skipping: the KV loop of a tile stops at its last token's position (the
diagonal), and runs in two phases: whole BLOCK_N tiles every row of the tile sees, with no
mask and unmasked loads, then the diagonal band with the causal mask.

Whole prompts (nothing cached before any of them: prefill_attention_triton) run the same
kernel with its keys read from the step's own K/V rows instead (KV_SOURCE "rows", or
"descriptor" for TMA tensor descriptors on sm_90+): a key tile is consecutive rows of one
matrix, not a gather through the block table, so its loads need no per-row addresses.

Tile shapes per head_dim: triton_attention_tuning.py (or triton.autotune on CUDA, opt-in, for
the paged kernel).
"""
import functools
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels._triton_utils import (
    LOG2E,
    dot_precision,
    has_tma,
    last_dim_contiguous,
    next_pow2,
)
from kernels.triton_attention_tuning import (
    OWN_ROWS_TMA_TILES,
    Tile,
    autotune_enabled,
    own_rows_tile,
    prefill_autotune_space,
    prefill_tile,
    token_bucket,
)
from kernels.triton_paged_attend import attend_paged, attend_rows

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis
KVSource = Literal["paged", "rows", "descriptor"]  # where the kernel reads keys and values


@triton.jit
def _find_tile(pid, cu_seqlens_q_ptr, batch, TILE_TOKENS: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, end) of tile pid: end is the running tile count at that sequence's last tile,
    seq == batch past the last tile (the grid is an upper bound)."""
    seq = 0
    end = 2147483647
    carry = 0  # tiles of the chunks before
    for b0 in range(0, batch, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        q_lens = (tl.load(cu_seqlens_q_ptr + 1 + b, mask=b < batch, other=0)
                  - tl.load(cu_seqlens_q_ptr + b, mask=b < batch, other=0))
        tiles = (q_lens + TILE_TOKENS - 1) // TILE_TOKENS
        ends = tl.where(b < batch, carry + tl.cumsum(tiles, axis=0), 2147483647)
        seq += tl.sum((ends <= pid).to(tl.int32), axis=0)
        end = tl.minimum(end, tl.min(tl.where(ends > pid, ends, 2147483647), axis=0))
        carry += tl.sum(tiles, axis=0)
    return seq, end


# batch changes every step; tokens_bucket is only the autotune key (unused in the body). A
# mixed step passes block_tables[nd:] and seq_lens[nd:], whose 16-byte alignment depends on
# its number of decode rows: specialized on it, every new alignment would compile the kernel
# again in the middle of serving.
@triton.jit(do_not_specialize=["batch", "tokens_bucket", "block_tables_ptr", "seq_lens_ptr"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                    seq_lens_ptr, out_ptr, k_rows, v_rows, qk_scale, batch,
                    tokens_bucket,  # noqa: ARG001
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kb, stride_ks, stride_kh, stride_rt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    HEADS_FIRST: tl.constexpr, KV_SOURCE: tl.constexpr,
                    LAZY_RESCALE: tl.constexpr = False):
    pid = tl.program_id(1 if HEADS_FIRST else 0)
    kv_head = tl.program_id(0 if HEADS_FIRST else 1)
    seq, end = _find_tile(pid, cu_seqlens_q_ptr, batch, TILE_TOKENS, BLOCK_B)
    if seq >= batch:
        return
    # Last tile first: causal tiles get longer towards the end, and starting the longest ones
    # early shortens the tail of the launch.
    tile = end - 1 - pid
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if KV_SOURCE == "paged":  # noqa: SIM108  (only the taken side of a constexpr if compiles)
        seq_len = tl.load(seq_lens_ptr + seq)
    else:  # whole prompts: nothing cached before them
        seq_len = q_len
    context = seq_len - q_len  # cached tokens before the first new one

    r = tl.arange(0, BLOCK_M)
    tok = tile * TILE_TOKENS + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < TILE_TOKENS * GROUP) & (tok < q_len)
    # Spare rows pretend to be the last token so that no row is fully masked (no NaN).
    q_pos = tl.where(row_mask, context + tok, seq_len - 1)
    d = tl.arange(0, BLOCK_D)
    qo_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=qo_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_pos = context + tile * TILE_TOKENS
    last_pos = tl.minimum(first_pos + TILE_TOKENS, seq_len) - 1
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # every row of the tile sees [0, full_end)
    if KV_SOURCE == "paged":
        acc, m_i, l_i = _attend_cache(
            acc, m_i, l_i, q, q_pos, block_tables_ptr + seq.to(tl.int64) * stride_bt,
            k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_kh, stride_kb,
            stride_ks, d, full_end, last_pos + 1, qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            BLOCK_D, DOT_PRECISION, LAZY_RESCALE)
    else:
        acc, m_i, l_i = _attend_own_rows(
            acc, m_i, l_i, q, q_pos, k_rows, v_rows, q_start, kv_head * HEAD_DIM, stride_rt, d,
            full_end, last_pos + 1, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION,
            LAZY_RESCALE, KV_SOURCE == "descriptor")
    acc = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _attend_cache(acc, m_i, l_i, q, q_pos, table, k_base, v_base, stride_kb, stride_ks, d,
                  full_end, end, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  LAZY_RESCALE: tl.constexpr):
    """Keys [0, end) through the block table: whole tiles unmasked, then the causal band (K and
    V caches share one layout)."""
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_pos, table, k_base, v_base, stride_kb,
                                 stride_ks, stride_kb, stride_ks, d, 0, full_end, qk_scale,
                                 "none", HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION,
                                 LAZY_RESCALE)
    return attend_paged(acc, m_i, l_i, q, q_pos, table, k_base, v_base, stride_kb, stride_ks,
                        stride_kb, stride_ks, d, full_end, end, qk_scale, "causal", HEAD_DIM,
                        BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION, LAZY_RESCALE)


@triton.jit
def _attend_own_rows(acc, m_i, l_i, q, q_pos, k_rows, v_rows, q_start, col, stride_rt, d,
                     full_end, end, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     LAZY_RESCALE: tl.constexpr, DESCRIPTOR: tl.constexpr):
    """Keys [0, end) from the prompt's own rows (from row q_start, head columns from col), in
    the same two phases; k_rows / v_rows are descriptors, or base pointers."""
    if DESCRIPTOR:
        k_src, v_src = k_rows, v_rows
    else:
        k_src, v_src = k_rows + col, v_rows + col
    acc, m_i, l_i = attend_rows(acc, m_i, l_i, q, q_pos, k_src, v_src, q_start, col, stride_rt,
                                d, 0, full_end, qk_scale, "none", HEAD_DIM, BLOCK_N, BLOCK_D,
                                DOT_PRECISION, LAZY_RESCALE, DESCRIPTOR)
    return attend_rows(acc, m_i, l_i, q, q_pos, k_src, v_src, q_start, col, stride_rt, d,
                       full_end, end, qk_scale, "causal", HEAD_DIM, BLOCK_N, BLOCK_D,
                       DOT_PRECISION, LAZY_RESCALE, DESCRIPTOR)


@functools.cache
def _autotuned_kernel(block_d: int):
    """_prefill_kernel under triton.autotune over BLOCK_N / num_warps / num_stages (CUDA only;
    results are cached per key for the process)."""
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
               for n, w, s in prefill_autotune_space(block_d)]
    return triton.autotune(configs, key=["HEAD_DIM", "GROUP", "tokens_bucket"])(_prefill_kernel)


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   seq_lens: torch.Tensor, scale: float,
                                   out: torch.Tensor | None = None, *,
                                   tile: Tile | None = None) -> torch.Tensor:
    """Same contract as paged_prefill_attention_torch; tile overrides the table's (and autotune)
    for benchmarks/attention.py --sweep-tiles."""
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    return _launch(q, cu_seqlens_q, seq_lens.shape[0], num_kv_heads, scale, out, tile, "paged",
                   (k_cache, v_cache, block_tables, seq_lens, q, q),  # q: rows unused
                   (block_tables.stride(0), *k_cache.stride()[:3], 0), block_size)


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, scale: float,
                             out: torch.Tensor | None = None, *, tile: Tile | None = None,
                             descriptor: bool | None = None) -> torch.Tensor:
    """Causal attention of whole prompts over their own K/V, k/v: [num_tokens, kv_heads,
    head_dim] (rows of one token, any row stride: views of the qkv projection), nothing
    cached before them; what paged_prefill_attention_triton computes when every seq_len equals
    its q_len, without the block table's gathers. descriptor: K/V tiles through tensor
    descriptors (TMA); by default in 16 bits where the GPU has them (sm_90+) and head_dim is a
    power of two.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    assert k.shape == v.shape
    if k.stride() != v.stride() or k.stride(2) != 1 or k.stride(1) != head_dim:
        k, v = k.contiguous(), v.contiguous()  # one layout, a token's heads side by side
    block_d = next_pow2(head_dim)
    if descriptor is None:
        # fp32 (exactness runs) keeps pointers: its descriptor path spills 272 bytes on sm_90
        descriptor = (head_dim in OWN_ROWS_TMA_TILES and q.dtype != torch.float32
                      and has_tma(k.device) and _tma_aligned(k, v))
    assert not descriptor or head_dim == block_d, "a descriptor's box must not pass the head"
    chosen = tile or own_rows_tile(block_d, q.dtype, descriptor)
    rows = (k, v)
    if descriptor and k.shape[0]:
        from triton.tools.tensor_descriptor import TensorDescriptor
        rows = tuple(TensorDescriptor(x, [x.shape[0], num_kv_heads * head_dim], [x.stride(0), 1],
                                      [chosen.block_n, block_d]) for x in (k, v))
    return _launch(q, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, num_kv_heads, scale, out, chosen,
                   "descriptor" if descriptor else "rows", (q, q, cu_seqlens_q, cu_seqlens_q, *rows),
                   (0, 0, 0, 0, k.stride(0)), 1)  # no cache, table or block size: placeholders


def _tma_aligned(*xs: torch.Tensor) -> bool:
    """A tensor descriptor's base and row stride must be multiples of 16 bytes."""
    return all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in xs)


def _launch(q, cu_seqlens_q, batch, num_kv_heads, scale, out, tile, kv_source: KVSource,
            tensors, strides, block_size):
    """Both wrappers' launch: the GQA packing of query tiles, the grid, the tile or autotune."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1, "rows of head_dim, any row stride"
    if num_tokens == 0 or batch == 0:
        return out
    q = last_dim_contiguous(q)
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    chosen, tile = tile, tile or prefill_tile(block_d, q.dtype)
    # Rows are (token, head of the group) pairs: a tile holds block_m // group tokens.
    tile_tokens = max(1, tile.block_m // group)
    max_tiles = triton.cdiv(num_tokens, tile_tokens) + batch  # bounds sum(ceil(q_len / tile))
    if (chosen is None and kv_source == "paged" and autotune_enabled(q.device)
            and q.dtype != torch.float32):
        kernel, launch = _autotuned_kernel(block_d), {}
    else:
        kernel = _prefill_kernel
        launch = dict(BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages,
                      LAZY_RESCALE=tile.lazy_rescale)
    heads_first = max_tiles <= MAX_GRID_Y
    grid = (num_kv_heads, max_tiles) if heads_first else (max_tiles, num_kv_heads)
    k_cache, v_cache, block_tables, seq_lens, k_rows, v_rows = tensors
    kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_rows, v_rows,
        scale * LOG2E, batch, token_bucket(num_tokens),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
        GROUP=group, HEAD_DIM=head_dim, TILE_TOKENS=tile_tokens, BLOCK_SIZE=block_size,
        BLOCK_M=max(16, next_pow2(tile_tokens * group)), BLOCK_D=block_d, BLOCK_B=64,
        DOT_PRECISION=dot_precision(q.dtype), HEADS_FIRST=heads_first, KV_SOURCE=kv_source,
        **launch)
    return out
