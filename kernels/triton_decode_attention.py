"""Triton paged decode attention, flash-decoding style.

Grid (batch, kv_head, split): each program owns one KV head and a contiguous slice of one
sequence's context, and computes all query heads of that KV head's GQA group at once, so each
K/V row is read from memory exactly once. A split's size is derived per sequence from its own
length (rounded up to BLOCK_N), so short sequences just leave later splits empty. Partial
results (normalised output + base-2 log-sum-exp per query head) are merged by a second small
kernel; with a single split the first kernel writes the final output directly.

The split count depends only on host-known sizes (batch, kv heads, block-table width), never
on seq_lens values: no device->host sync, and a CUDA graph captured for a batch size stays valid.
seq_lens must be >= 1 (the current token is always cached).
"""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import LOG2E, dot_precision, last_dim_contiguous, next_pow2, num_sms
from kernels.triton_paged_attend import attend_paged

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # below this per split, the merge costs more than the parallelism buys


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


# num_splits varies with the batch size: a runtime argument, so it never triggers a recompile.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                         out_ptr, mid_out_ptr, mid_lse_ptr, qk_scale, num_q_heads, num_splits,
                         stride_qb, stride_qh, stride_bt,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:
        return  # this sequence is too short to reach this split; the merge skips it

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    d_mask = d < HEAD_DIM
    qo_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qo_mask,
                other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, g, table, k_base, v_base, stride_kb, stride_ks,
                                 stride_vb, stride_vs, d, start, end, qk_scale,
                                 "tail", HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_PRECISION)

    acc = acc / l_i[:, None]
    if SINGLE_SPLIT:
        out_rows = seq * num_q_heads + heads
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        mid_rows = (seq * num_q_heads + heads) * num_splits + split  # index into [B, Hq, S]
        tl.store(mid_out_ptr + mid_rows[:, None] * HEAD_DIM + d[None, :], acc, mask=qo_mask)
        tl.store(mid_lse_ptr + mid_rows, m_i + tl.log2(l_i), mask=g < GROUP)


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
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # unused splits: exp2(-inf) = 0
    part = tl.load(mid_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough (batch x kv_head x split) programs to fill the GPU ~4 times over, but no more
    splits than the widest possible context (block-table width) can feed MIN_SPLIT_TOKENS each."""
    wanted = triton.cdiv(4 * num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_context, MIN_SPLIT_TOKENS)))


def _tile_config(block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Sized so that sm_90 compiles without register
    spills (checked by tests/kernels/sm90_compile.py); fp32 runs IEEE FMA dots, hence smaller."""
    if dtype == torch.float32:
        return 16, 4, 2
    return (64, 4, 2) if block_d <= 128 else (32, 4, 2)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  *, num_splits: int | None = None) -> torch.Tensor:
    """Same contract as paged_decode_attention_torch; num_splits overrides the heuristic."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    q = last_dim_contiguous(q)
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    block_n, num_warps, num_stages = _tile_config(block_d, q.dtype)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                        q.device)
    if num_splits > 1:
        mid_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        mid_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_out = mid_lse = out  # unused: the split kernel writes `out` itself
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_out, mid_lse, scale * LOG2E,
        num_q_heads, num_splits, q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SINGLE_SPLIT=num_splits == 1,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs M >= 16; spare rows are masked
        BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            mid_out, mid_lse, seq_lens, out, num_splits,
            HEAD_DIM=head_dim, BLOCK_N=block_n,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=4)
    return out
