"""KV store: a pure copy, so the Triton cache must equal the reference cache exactly."""
import pytest
import torch
from kernel_cases import DEVICE, DTYPES

from kernels.kv_store import store_kvcache_torch
from kernels.triton_kv_store import store_kvcache_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 80), (8, 128)])
def test_store_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    num_blocks, num_tokens = 6, 40
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    # Key and value are slices of a fused qkv output (strided views), as in the model.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    width = num_kv_heads * head_dim
    key = qkv[:, width:2 * width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * width:].view(num_tokens, num_kv_heads, head_dim)
    # Distinct slots across block boundaries, with padding (-1) tokens in between.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    store_kvcache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_all_padding_and_empty():
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 64, device=DEVICE)
    store_kvcache_triton(key, key, k_cache, v_cache, torch.full((3,), -1, device=DEVICE))
    no_slots = torch.zeros(0, dtype=torch.long, device=DEVICE)
    store_kvcache_triton(key[:0], key[:0], k_cache, v_cache, no_slots)
    assert not k_cache.any() and not v_cache.any()
