"""Paged attention: rotate and store this step's K/V (one fused op), then attend decodes and
prefill chunks separately."""
import torch
from torch import nn

from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.norm import RMSNorm
from flagserve.layers.rotary import RotaryEmbedding
from kernels import KernelOps


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops: KernelOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                positions: torch.Tensor, rotary: RotaryEmbedding, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] straight from the qkv projection -> [T, Hq, D].
        The optional q/k norms, rotary and the cache store run first, as one fused op."""
        # Whole prompts (nothing cached, no decodes) attend over their own rotated keys, where
        # the ops can: no block-table gathers.
        own_rows = meta.whole_prompts and self.ops.prefill_attention is not None
        q = rotary(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, q_norm, k_norm,
                   rotate_k=own_rows)
        if own_rows:
            return self.ops.prefill_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self.ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                   meta.seq_lens, self.scale, order=meta.decode_order)
        if nd == 0:
            return self.ops.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                                    meta.cu_seqlens_q, meta.seq_lens, self.scale)
        # Each half written in place (kernels/out_arg.py); contiguous whatever q's strides.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.ops.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd],
                                        meta.seq_lens[:nd], self.scale, out[:nd],
                                        order=meta.decode_order)
        self.ops.paged_prefill_attention(q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                                         meta.cu_seqlens_q, meta.seq_lens[nd:], self.scale, out[nd:])
        return out
