"""What a router remembers about prefixes: which replica was sent which leading blocks.

A prompt's key is the chained hash of each of its first `max_blocks` full blocks, computed
as the engine's block manager computes them (engine/block_manager.chain_hash), so block i's
hash stands for blocks 0..i. A replica that was sent hash i has therefore seen the whole
prefix up to block i, and the depth a replica matches is the deepest such i.

The table is a guess, not the engine's truth: an engine evicts blocks it needs (LRU) without
telling its callers, and each caller (ingress replica) keeps a table of its own. A stale
entry costs one prefill recomputed, never a wrong answer.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flagserve.engine.block_manager import chain_hash

# Hashes remembered per router; at 32 blocks a prompt this is ~3k distinct long prompts.
TABLE_ENTRIES = 100_000


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's leading full blocks (none for a prompt under one block)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = chain_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixTable:
    """Block hash -> the replicas it was routed to, least recently routed hashes evicted first."""

    def __init__(self, capacity: int = TABLE_ENTRIES):
        self.capacity = capacity
        self._holders: OrderedDict[int, dict[str, None]] = OrderedDict()  # dict: ordered set

    def depths(self, hashes: Sequence[int]) -> dict[str, int]:
        """Replica -> how many leading blocks of `hashes` it was sent (absent: none)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes, 1):
            for replica in self._holders.get(h, ()):
                depth[replica] = i
        return depth

    def insert(self, hashes: Sequence[int], replica: str) -> None:
        for h in hashes:
            self._holders.setdefault(h, {})[replica] = None
            self._holders.move_to_end(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that is gone (scaled down, died) holds nothing any more."""
        for h in [h for h, holders in self._holders.items() if replica in holders]:
            del self._holders[h][replica]
            if not self._holders[h]:
                del self._holders[h]

    def __len__(self) -> int:
        return len(self._holders)
