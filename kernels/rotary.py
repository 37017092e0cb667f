"""Rotary position embedding (neox style: rotate the two halves of each head), in place.

cos_sin_cache: [max_position, head_dim] fp32, cos of the rotary angles in the first half and
sin in the second; scaled frequencies (Llama-3, linear) are already folded into it.
"""
import torch


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # Per element the same products and sums as HF's x * cos + rotate_half(x) * sin.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x1.copy_(o1)
    x2.copy_(o2)


def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin_cache: torch.Tensor) -> None:
    """q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)
