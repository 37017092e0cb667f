"""The inner loop both paged attention kernels share: online softmax over a range of one
sequence's cached positions, each token found through the block table (any block size)."""
import triton
import triton.language as tl


@triton.jit
def attend_paged(acc, m_i, l_i, q, q_pos, table, k_base, v_base, stride_kb, stride_ks, stride_vb,
                 stride_vs, d, lo, hi, qk_scale,
                 MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax accumulation of q's rows over cached positions [lo, hi) of one sequence.

    MASK: "none" (every tile full: the caller aligned hi), "tail" (positions >= hi masked),
    or "causal" (also position > q_pos masked, per row).
    """
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        k_rows = block * stride_kb + (n % BLOCK_SIZE) * stride_ks
        v_rows = block * stride_vb + (n % BLOCK_SIZE) * stride_vs
        # Masking d only when head_dim is padded keeps the K/V loads vectorised.
        if HEAD_DIM != BLOCK_D:
            kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        else:
            kv_mask = tl.broadcast_to(n_mask[:, None], (BLOCK_N, BLOCK_D))
        k = tl.load(k_base + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASK == "causal":
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        elif MASK == "tail":
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
