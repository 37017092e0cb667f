"""Paged decode attention: one query token per sequence against that sequence's cached K/V.

q: [batch, num_q_heads, head_dim]; block_tables: [batch, max_blocks] int32 (entries past a
sequence's last block are ignored); seq_lens: [batch] int32, the number of cached tokens
(the current token included). Returns [batch, num_q_heads, head_dim].
"""
import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[batch, num_blocks * block_size, num_kv_heads, head_dim] view of each sequence's blocks."""
    blocks = cache[block_tables[:, :num_blocks].long()]
    return blocks.flatten(1, 2)


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    k = gather_kv(k_cache, block_tables, num_blocks).transpose(1, 2)  # [B, Hkv, T, D]
    v = gather_kv(v_cache, block_tables, num_blocks).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < seq_lens[:, None].to(q.device))[:, None, None, :]  # [B,1,1,T]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)
