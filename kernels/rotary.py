"""Rotary position embedding (neox style: rotate the two halves of each head), in place.

cos_sin_cache: [max_position, head_dim] fp32, cos of the rotary angles in the first half and
sin in the second; scaled frequencies (Llama-3, linear) are already folded into it.
"""
import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin_cache: torch.Tensor) -> None:
    """q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
