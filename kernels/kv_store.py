"""Write new tokens' K and V into the paged cache.

Cache layout (every kernel shares it): [num_blocks, block_size, num_kv_heads, head_dim].
Slot s is row s of the cache viewed as [num_blocks * block_size, num_kv_heads, head_dim];
a negative slot marks a padding token that must not be written.
"""
import torch


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat[slots] = key[valid]
    v_flat[slots] = value[valid]
