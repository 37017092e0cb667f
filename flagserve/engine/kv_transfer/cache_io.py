"""Blocks of an engine's paged KV cache as one contiguous tensor, and back.

The cache is per layer: K and V of shape [num_blocks, block_size, kv_heads, head_dim]. A
transfer moves [num_layers, 2, n, block_size, kv_heads, head_dim]: one tensor, so one send.
"""
from __future__ import annotations

import torch

from flagserve.engine.kv_transfer.handoff import KVLayout


class KVCaches:
    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers  # (k_cache, v_cache) per layer, the runner's own tensors
        k = layers[0][0]
        self.device = k.device
        self.layout = KVLayout(len(layers), k.shape[1], k.shape[2], k.shape[3], str(k.dtype))

    @classmethod
    def of_runner(cls, runner) -> KVCaches:
        return cls([(a.k_cache, a.v_cache) for a in runner.model.attention_layers()])

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        lay = self.layout
        return (lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)

    def empty(self, num_blocks: int) -> torch.Tensor:
        return torch.empty(self.shape(num_blocks), dtype=self.layers[0][0].dtype, device=self.device)

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """A copy of the blocks' K/V: the blocks may be freed once this returns."""
        idx = self._index(blocks)
        out = self.empty(len(blocks))
        for i, (k, v) in enumerate(self.layers):
            torch.index_select(k, 0, idx, out=out[i, 0])
            torch.index_select(v, 0, idx, out=out[i, 1])
        return out

    def scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        if tuple(data.shape) != self.shape(len(blocks)):
            raise ValueError(f"received KV of shape {tuple(data.shape)}, expected "
                             f"{self.shape(len(blocks))}")
        idx = self._index(blocks)
        for i, (k, v) in enumerate(self.layers):
            k.index_copy_(0, idx, data[i, 0])
            v.index_copy_(0, idx, data[i, 1])
