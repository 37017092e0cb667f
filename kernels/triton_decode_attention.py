"""Triton paged decode attention: one query token per sequence, two paths.

Single pass, grid (kv_head, batch): one program streams a whole sequence's context for one KV
head and writes the output itself. One launch, no scratch buffers: the path for large
batches (batch x kv_heads programs already fill the GPU) and short contexts (one program
reads the context faster than a second launch would cost).

Split-K (flash-decoding), grid (kv_head, batch, split): only when the batch leaves most SMs
idle and the context may be long. Each split covers a slice of the context sized from the
sequence's own length (rounded up to BLOCK_N), so short sequences leave later splits empty;
partial outputs and base-2 log-sum-exps go to fp32 scratch and a second kernel merges them.

Either way a program computes all query heads of its KV head's GQA group, so each K/V row is
read once. The path and split count come from host-known sizes only (batch, kv heads, dtype,
block-table width), never from seq_lens values: no device->host sync, and the choice is fixed
for a CUDA graph captured at one batch size and table width. A row with seq_len 0 (padding)
yields zeros; padded rows need a valid block-table row (zeros: block 0) and nothing else.

Launch order: the KV heads of a sequence side by side, and the sequences in `order` when the
caller gives one (a permutation of the rows; the engine passes longest first, built on the
host with the step's inputs). Programs are as long as their contexts, so a long one launched
last runs alone at the end of the kernel at one program's bandwidth; longest first fills that
tail with short ones (a simulation of nano-vllm's batches put it at 1-9% of the kernel's time
at 80-200 rows, docs/performance.md). The result does not depend on the order.
"""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import LOG2E, dot_precision, last_dim_contiguous, next_pow2, num_sms
from kernels.triton_attention_tuning import Tile, decode_tile
from kernels.triton_paged_attend import attend_paged

# Path choice (tiles: triton_attention_tuning.py). benchmarks/attention.py prints both paths.
SPLIT_WAVES = 4  # split-K aims at this many programs per SM
# One 64-key tile per split at the least. Decode runs in CUDA graphs, where the merge's launch
# costs nothing: while batch x kv_heads programs leave SMs idle, even a 512-token context is
# faster cut in 64-token splits than read by one program (the split sweep under CUDA graphs,
# docs/performance.md; eager timings had hidden it under launch time).
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64  # a power of two: the merge kernel spans it with one tl.arange


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _context_range(seq_len, split, num_splits, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of this program's context; start is a multiple of BLOCK_N."""
    if SPLIT:
        split_len = _split_len(seq_len, num_splits, BLOCK_N)
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
    else:
        start = 0
        end = seq_len
    return start, end


# num_splits varies with the batch size: a runtime argument, so it never triggers a recompile.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
                   out_ptr, mid_out_ptr, mid_lse_ptr, qk_scale, num_q_heads, num_splits,
                   stride_qb, stride_qh, stride_bt, stride_kb, stride_ks, stride_kh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, ORDERED: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    if ORDERED:
        seq = tl.load(order_ptr + seq).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _context_range(seq_len, split, num_splits, SPLIT, BLOCK_N)
    if SPLIT and start >= end:
        return  # this sequence is too short to reach this split; the merge skips it

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    qo_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qo_mask,
                other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh  # K and V caches share one layout
    full_end = start + (end - start) // BLOCK_N * BLOCK_N  # whole tiles: no masks at all
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, g, table, k_base, v_base, stride_kb, stride_ks,
                                 stride_kb, stride_ks, d, start, full_end, qk_scale,
                                 "none", HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION)
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, g, table, k_base, v_base, stride_kb, stride_ks,
                                 stride_kb, stride_ks, d, full_end, end, qk_scale,
                                 "tail", HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (padding): zeros, not NaN
    if SPLIT:
        mid_rows = (seq * num_q_heads + heads) * num_splits + split  # index into [B, Hq, S]
        tl.store(mid_out_ptr + mid_rows[:, None] * HEAD_DIM + d[None, :], acc, mask=qo_mask)
        tl.store(mid_lse_ptr + mid_rows, m_i + tl.log2(l_i), mask=g < GROUP)
    else:
        out_rows = seq * num_q_heads + heads
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(mid_out_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    row = seq * tl.num_programs(1) + tl.program_id(1)  # index into [B, Hq]
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.maximum(_split_len(seq_len, num_splits, BLOCK_N), 1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < tl.cdiv(seq_len, split_len)  # splits that wrote a partial result
    d_mask = d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))  # unused: 0
    part = tl.load(mid_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def split_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split-K's split count: enough (batch x kv_head x split) programs for SPLIT_WAVES per SM,
    but no more splits than the widest possible context can feed MIN_SPLIT_TOKENS each."""
    wanted = triton.cdiv(SPLIT_WAVES * num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_context, MIN_SPLIT_TOKENS)))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """1 (single pass) when batch x kv_heads programs fill every SM, otherwise split-K's count.
    max_context is the block-table width in tokens: an upper bound known on the host."""
    if batch * num_kv_heads >= num_sms(device):
        return 1
    return split_num_splits(batch, num_kv_heads, max_context, device)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  out: torch.Tensor | None = None, order: torch.Tensor | None = None,
                                  *, num_splits: int | None = None,
                                  tile: Tile | None = None) -> torch.Tensor:
    """Same contract as paged_decode_attention_torch; order ([batch] int32, a permutation of
    the rows) the sequences' launch order, num_splits overrides the choice (1: the single
    pass; more: split-K), tile the tuning table's launch settings."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.is_contiguous(), "the kernel writes [batch, Hq, D] rows"
    if batch == 0:
        return out
    q = last_dim_contiguous(q)
    block_d = next_pow2(head_dim)
    tile = tile or decode_tile(block_d, q.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                       q.device)
    split = num_splits > 1
    if split:
        mid_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        mid_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_out = mid_lse = out  # unused: the single pass writes `out` itself
    assert order is None or (order.shape == (batch,) and order.dtype == torch.int32)
    _decode_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if order is None else order, out,
        mid_out, mid_lse, scale * LOG2E,
        num_q_heads, num_splits, q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SPLIT=split,
        BLOCK_G=max(tile.block_m, next_pow2(num_q_heads // num_kv_heads)),  # tl.dot: M >= 16
        BLOCK_N=tile.block_n, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        ORDERED=order is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if split:
        _decode_merge_kernel[(batch, num_q_heads)](
            mid_out, mid_lse, seq_lens, out, num_splits,
            HEAD_DIM=head_dim, BLOCK_N=tile.block_n,
            BLOCK_S=MAX_SPLITS, BLOCK_D=block_d, num_warps=4)  # one variant for every count
    return out
