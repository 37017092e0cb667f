"""The torch decode reference splits big batches into length buckets: same result as one call."""
import torch

from kernels.decode_attention import MIN_BUCKETED_BATCH, _attend, paged_decode_attention_torch


def test_length_buckets_match_one_padded_call():
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, block = 3 * MIN_BUCKETED_BATCH, 8, 2, 32, 16
    k_cache = torch.randn(400, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(400, block, kv_heads, dim, generator=gen)
    seq_lens = torch.randint(1, 300, (batch,), generator=gen, dtype=torch.int32)
    tables = torch.randint(0, 400, (batch, 19), generator=gen, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=gen)
    bucketed = paged_decode_attention_torch(q, k_cache, v_cache, tables, seq_lens, 0.2)
    single = _attend(q, k_cache, v_cache, tables, seq_lens, int(seq_lens.max()), 0.2)
    torch.testing.assert_close(bucketed, single, rtol=1e-5, atol=1e-6)
