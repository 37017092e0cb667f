"""Paged decode attention: one query token per sequence against that sequence's cached K/V.

q: [batch, num_q_heads, head_dim]; block_tables: [batch, max_blocks] int32 (entries past a
sequence's last block are ignored); seq_lens: [batch] int32, the number of cached tokens
(the current token included). Returns [batch, num_q_heads, head_dim]: `out` where given
(kernels/out_arg.py). `order` ([batch] int32, a permutation of the rows, or None) is a hint
of the order to work through the sequences in, longest first from the engine (the Triton
kernel's launch order); the result never depends on it, and implementations may ignore it.
"""
import torch
import torch.nn.functional as F

from kernels.out_arg import written


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[batch, num_blocks * block_size, num_kv_heads, head_dim] view of each sequence's blocks."""
    batch = block_tables.shape[0]
    # index_select over whole blocks copies rows with memcpy; advanced indexing is ~2x slower on CPU.
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables[:, :num_blocks].flatten().long())
    return rows.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_blocks = (max_len + block_size - 1) // block_size
    k = gather_kv(k_cache, block_tables, num_blocks).transpose(1, 2)  # [B, Hkv, T, D]
    v = gather_kv(v_cache, block_tables, num_blocks).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < seq_lens[:, None].to(q.device))[:, None, None, :]  # [B,1,1,T]
    # The query heads of one KV head become its "query tokens": one 4-D SDPA call on CPU's
    # flash kernel with no K/V expansion (the mask is the same for every query of a sequence).
    grouped = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


BUCKETS = 4  # length buckets of a large decode batch
MIN_BUCKETED_BATCH = 16


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float, out: torch.Tensor | None = None,
                                 order: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ARG001
    lens = seq_lens.tolist()
    if len(lens) < MIN_BUCKETED_BATCH:
        return written(out, _attend(q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale))
    # Gathering every sequence to the longest one's length wastes half the work on uniform
    # lengths; quartiles of similar length cut the padding to about a quarter.
    order = sorted(range(len(lens)), key=lens.__getitem__)
    out = torch.empty_like(q) if out is None else out
    step = -(-len(order) // BUCKETS)
    for start in range(0, len(order), step):
        rows = order[start:start + step]
        idx = torch.tensor(rows, device=q.device)
        out[idx] = _attend(q[idx], k_cache, v_cache, block_tables[idx], seq_lens[idx],
                           lens[rows[-1]], scale)
    return out
