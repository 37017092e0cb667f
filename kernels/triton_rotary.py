"""Triton rotary embedding (neox style), applied to q and k in place in one launch.

q and k may be strided views (e.g. slices of a fused qkv projection): the kernel takes token
and head strides and only needs unit stride along head_dim. Arithmetic mirrors the reference
op by op (cos/sin rounded to the model dtype, each product and the sum rounded) so 16-bit
results match the torch/HF path bit for bit rather than just closely.
"""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import next_pow2


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & (d < half)[None, :]
        ptr1 = x_ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(ptr1, mask=mask, other=0.0)
        x2 = tl.load(ptr1 + half, mask=mask, other=0.0)
        dtype = x1.dtype
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        x1c = (x1f * cos).to(dtype).to(tl.float32)
        x2c = (x2f * cos).to(dtype).to(tl.float32)
        x1s = (x1f * sin).to(dtype).to(tl.float32)
        x2s = (x2f * sin).to(dtype).to(tl.float32)
        tl.store(ptr1, (x1c - x2s).to(dtype), mask=mask)
        tl.store(ptr1 + half, (x2c + x1s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                   num_q_heads, num_kv_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cs_mask = d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=cs_mask, other=0.0)
    # The reference casts the fp32 table to the model dtype before multiplying.
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)


def rotary_embedding_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            cos_sin_cache: torch.Tensor) -> None:
    """q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim, "rotary over the full head_dim only"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "in-place rotary needs unit stride on head_dim"
    assert q.dtype == k.dtype and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = next_pow2(half)
    block_h = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 2048 // block_half))
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, half,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
