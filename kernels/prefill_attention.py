"""Prefill / extend attention over the paged cache.

q holds the new tokens of a variable-length batch flattened to [num_tokens, num_q_heads,
head_dim]; sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. Its K/V (cached prefix and
the new tokens, already stored) live in the blocks of block_tables[b], seq_lens[b] tokens in
all. New token i of sequence b sits at position seq_lens[b] - q_len + i and attends causally
to every position up to its own, so prefix-cache hits and chunked prefill are the same case.
The result goes to `out` where given (kernels/out_arg.py).
"""
import torch
import torch.nn.functional as F

from kernels.decode_attention import gather_kv


def paged_prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  seq_lens: torch.Tensor, scale: float,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    block_size = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    starts = cu_seqlens_q.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (kv_len + block_size - 1) // block_size
        # 4-D [1, heads, tokens, head_dim]: CPU SDPA takes its flash kernel only for 4-D inputs.
        k = gather_kv(k_cache, block_tables[b:b + 1], num_blocks)[:, :kv_len].transpose(1, 2)
        v = gather_kv(v_cache, block_tables[b:b + 1], num_blocks)[:, :kv_len].transpose(1, 2)
        qb = q[q_start:q_end].transpose(0, 1).unsqueeze(0)
        if q_len == kv_len:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
