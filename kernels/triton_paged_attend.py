"""The inner loop both paged attention kernels share: online softmax over a range of one
sequence's cached positions, each token found through the block table (any block size)."""
import triton
import triton.language as tl


@triton.jit
def _load_kv(ptrs, n_mask, d, ROWS_MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr):
    # Unmasked loads (whole tiles, unpadded head_dim) stay 16-byte vectorised and skip the
    # predicate work; the d-mask only exists when head_dim is padded to BLOCK_D.
    if ROWS_MASKED:
        if HEAD_DIM != BLOCK_D:
            return tl.load(ptrs, mask=n_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        return tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    if HEAD_DIM != BLOCK_D:
        return tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def attend_paged(acc, m_i, l_i, q, q_pos, table, k_base, v_base, stride_kb, stride_ks, stride_vb,
                 stride_vs, d, lo, hi, qk_scale,
                 MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 LAZY_RESCALE: tl.constexpr = False):
    """Online-softmax accumulation of q's rows over cached positions [lo, hi) of one sequence.

    MASK: "none" (the caller guarantees whole tiles: hi - lo is a multiple of BLOCK_N and every
    row sees every position, so neither scores nor K/V loads are masked), "tail" (positions >=
    hi masked), or "causal" (also positions > q_pos masked, per row).

    LAZY_RESCALE (prefill; the caller guarantees every row sees a position of the first tile):
    a row's running max moves only when some row's max grew by more than 2**8, so most tiles
    skip the rescale of the whole accumulator (a BLOCK_M x BLOCK_D multiply, ~23% of the
    instructions of a 32-key iteration at head_dim 128 in the sm_90 code); exponents are then
    taken against a max up to 8 below the true one, so p <= 2**8, exact in fp32 and in range
    in 16 bits, and acc / l is unchanged.
    """
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = (n % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (block * stride_kb + offset * stride_ks)[:, None] + d[None, :]
        k = _load_kv(k_ptrs, n_mask, d, MASK != "none", HEAD_DIM, BLOCK_D)
        # Scores stay unscaled: the scale rides in the max's one multiply and the exponent's
        # FMA, not a pass over the tile (an H100's prefill measured 0.5-2% faster).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK == "causal":
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        elif MASK == "tail":
            s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i, p = softmax_step(acc, m_i, l_i, s, qk_scale, LAZY_RESCALE)
        v_ptrs = v_base + (block * stride_vb + offset * stride_vs)[:, None] + d[None, :]
        v = _load_kv(v_ptrs, n_mask, d, MASK != "none", HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def softmax_step(acc, m_i, l_i, s, qk_scale, LAZY_RESCALE: tl.constexpr):
    """One key tile's online-softmax update from its (masked, unscaled) scores s: the running
    max, the sums rescaled to it, and the tile's probabilities p (for the caller's p @ V)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    if LAZY_RESCALE:
        # -inf to a finite max (a row's first position) is growth too: it always rescales
        grew = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), axis=0)
        if grew > 8.0:
            acc, l_i, m_i = _rescale(acc, l_i, m_i, m_new)
    else:
        acc, l_i, m_i = _rescale(acc, l_i, m_i, m_new)
    p = tl.exp2(s * qk_scale - m_i[:, None])
    return acc, m_i, l_i + tl.sum(p, axis=1), p


@triton.jit
def _rescale(acc, l_i, m_i, m_new):
    """The running sums moved to the new max (the online softmax's correction)."""
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha, m_new


@triton.jit
def attend_rows(acc, m_i, l_i, q, q_pos, k_src, v_src, row0, col, stride_t, d, lo, hi, qk_scale,
                MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                DESCRIPTOR: tl.constexpr):
    """attend_paged over positions [lo, hi) whose K/V are rows row0 + position of a plain
    [tokens, heads * head_dim] matrix (a whole prompt's own keys), head columns from col.

    DESCRIPTOR: k_src / v_src are tensor descriptors of [BLOCK_N, BLOCK_D] boxes (TMA on Hopper:
    one instruction a tile instead of an address per thread and row; the box must not reach
    past the head, so head_dim == BLOCK_D); else base pointers (already offset by col).
    MASK as attend_paged's ("none" or "causal"); a causal tile's rows past hi (the next
    prompt's, or past the matrix: zeros from the descriptor) are masked out of the scores.
    """
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        if DESCRIPTOR:
            k = k_src.load([row0 + n0, col])
        else:
            rows = (row0 + n).to(tl.int64) * stride_t
            k = _load_kv(k_src + rows[:, None] + d[None, :], n_mask, d, MASK != "none",
                         HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK == "causal":
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i, p = softmax_step(acc, m_i, l_i, s, qk_scale, LAZY_RESCALE)
        if DESCRIPTOR:
            v = v_src.load([row0 + n0, col])
        else:
            v = _load_kv(v_src + rows[:, None] + d[None, :], n_mask, d, MASK != "none",
                         HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i
