"""Triton fused q/k RMSNorm (optional) + rotary + KV-cache store: one launch per layer where
the unfused model ran up to four (q norm, k norm, rotary, store), and k is read once.

Grid (token, part): part 0 normalises and rotates the token's query heads in place; part 1
does its key heads and writes them, with the value heads, to the token's cache slot (a
negative slot is padding: nothing is stored). Two programs per token halve the dependent
load->store chain a batch-1 decode waits on. Arithmetic mirrors the references op by op
(norm statistics in fp32, the normalised row rounded before the weight; cos/sin rounded to
the model dtype, each product and sum rounded), so 16-bit results match within 1 ulp.
"""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import last_dim_contiguous, next_pow2


@triton.jit
def _rounded(x, like):
    """x rounded to like's dtype, to be computed on in fp32."""
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def _norm_rotate(x1, x2, w_ptr, cos, sin, eps, half, d, QK_NORM: tl.constexpr):
    """[heads, half] first and second halves of some heads -> rotated halves (fp32 holding
    values of x's dtype), after the per-head RMSNorm when QK_NORM."""
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        mean_sq = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * half)
        rstd = tl.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
        x1f = _rounded(_rounded(x1f * rstd, x1) * w1, x1)
        x2f = _rounded(_rounded(x2f * rstd, x1) * w2, x1)
    o1 = _rounded(x1f * cos, x1) - _rounded(x2f * sin, x1)
    o2 = _rounded(x2f * cos, x1) + _rounded(x1f * sin, x1)
    return o1, o2


@triton.jit
def _rotary_store_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         cos_sin_ptr, qw_ptr, kw_ptr, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cb, stride_cs, stride_ch, stride_cos,
                         num_q_heads, num_kv_heads, half,
                         QK_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         ROTATE_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + d, mask=d < half, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + half + d, mask=d < half, other=0.0)
    # The reference casts the fp32 table to the model dtype before multiplying.
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        for h0 in range(0, num_q_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h < num_q_heads)[:, None] & (d < half)[None, :]
            ptr = q_ptr + token * stride_qt + h[:, None] * stride_qh + d[None, :]
            o1, o2 = _norm_rotate(tl.load(ptr, mask=mask, other=0.0),
                                  tl.load(ptr + half, mask=mask, other=0.0),
                                  qw_ptr, cos, sin, eps, half, d, QK_NORM)
            tl.store(ptr, o1.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(ptr + half, o2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # negative: a padding token (e.g. a CUDA-graph batch filler)
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            for h0 in range(0, num_kv_heads, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                mask = (h < num_kv_heads)[:, None] & (d < half)[None, :]
                src = k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :]
                dst = row + h[:, None] * stride_ch + d[None, :]
                o1, o2 = _norm_rotate(tl.load(src, mask=mask, other=0.0),
                                      tl.load(src + half, mask=mask, other=0.0),
                                      kw_ptr, cos, sin, eps, half, d, QK_NORM)
                tl.store(k_cache_ptr + dst, o1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_cache_ptr + dst + half, o2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                if ROTATE_K:  # whole prompts attend over these rows (prefill_attention_triton)
                    tl.store(src, o1.to(k_ptr.dtype.element_ty), mask=mask)
                    tl.store(src + half, o2.to(k_ptr.dtype.element_ty), mask=mask)
                src = v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :]
                for part in tl.static_range(2):  # v's halves: the same addressing as k's
                    v = tl.load(src + part * half, mask=mask)
                    tl.store(v_cache_ptr + dst + part * half,
                             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_store_kvcache_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor,
                                q_norm_weight: torch.Tensor | None = None,
                                k_norm_weight: torch.Tensor | None = None,
                                eps: float = 0.0, *, rotate_k: bool = False) -> torch.Tensor:
    """Same contract as rotary_store_kvcache_torch; q is rotated in place and returned.
    rotate_k: k too (normalised and rotated as stored), for attention over k's own rows."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert q.stride(-1) == 1, "in-place rotary needs unit stride on head_dim"
    assert k.stride(-1) == 1 or not rotate_k, "rotate_k writes k in place: unit stride on head_dim"
    assert q.dtype == k.dtype == v.dtype and k_cache.stride() == v_cache.stride()
    qk_norm = q_norm_weight is not None
    if qk_norm:  # the reference's output dtype would be promoted otherwise
        assert q_norm_weight.dtype == k_norm_weight.dtype == q.dtype
    if num_tokens == 0:
        return q
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    half = head_dim // 2
    block_half = next_pow2(half)
    block_h = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 2048 // block_half))
    _rotary_store_kernel[(num_tokens, 2)](
        positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache,
        q_norm_weight if qk_norm else q, k_norm_weight if qk_norm else q, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, half,
        QK_NORM=qk_norm, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_HALF=block_half,
        ROTATE_K=rotate_k, num_warps=4)
    return q
