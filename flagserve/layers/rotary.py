"""Rotary embedding: the frequency table (default, linear and Llama-3 scaling, GGUF frequency
factors) and its layer, which also stores K/V into the cache (one fused op)."""
import math

import torch
from torch import nn

from flagserve.layers.norm import RMSNorm
from flagserve.layers.rope import RopeConfig
from kernels import KernelOps


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = _scaled_inv_frequencies(head_dim, rope)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq


def _scaled_inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        inv_freq = inv_frequencies(head_dim, rope)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        # fp32 whatever the model dtype: angles at large positions need the precision.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                rotate_k: bool = False) -> torch.Tensor:
        """Rotates q and k (after Qwen3's per-head q/k RMSNorm when given) and stores k and v
        at their cache slots, as one fused op. Returns the query to attend with; q and k are
        scratch afterwards (the Triton op rotates q in place), unless rotate_k (only ops with
        a prefill_attention take it): then k holds the keys as stored."""
        kwargs = dict(rotate_k=True) if rotate_k else {}
        if q_norm is not None:
            kwargs.update(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, eps=q_norm.eps)
        return self.ops.rotary_store_kvcache(positions, q, k, v, k_cache, v_cache, slot_mapping,
                                             self.cos_sin_cache, **kwargs)
