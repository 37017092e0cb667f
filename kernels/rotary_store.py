"""Everything between the qkv projection and attention, as one op: Qwen3's per-head q/k
RMSNorm (optional), the rotary embedding of q and k, and the store of k and v into the paged
cache (layout and slot rules: kv_store.py; rotary rules: rotary.py).

The reference composes the three reference ops, so its numerics are those of the unfused
model. Returns the query to attend with. q and k are scratch: the reference may return new
tensors (the norm does), the Triton kernel rotates q in place and never writes k back.
"""
import torch

from kernels.kv_store import store_kvcache_torch
from kernels.rms_norm import rms_norm_torch
from kernels.rotary import rotary_embedding_torch


def rotary_store_kvcache_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor,
                               q_norm_weight: torch.Tensor | None = None,
                               k_norm_weight: torch.Tensor | None = None,
                               eps: float = 0.0) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D]; norm weights [D] (both or neither)."""
    if q_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    rotary_embedding_torch(positions, q, k, cos_sin_cache)
    store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping)
    return q
