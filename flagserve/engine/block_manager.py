"""Paged KV-cache bookkeeping: block tables, reference counts and the prefix cache.

A full block is identified by a chained hash of its tokens and every token before it, so
requests sharing a prefix share blocks. A hit is also checked against the block's stored tokens
and its parent's content id, so even a hash collision never hands out wrong K/V. Freed blocks
keep their contents and stay findable until they are reallocated (least recently freed first).
"""
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import numpy as np
import xxhash

from flagserve.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered
    uid: int = 0  # unique id of this block's current contents (0 = not full yet)
    parent_uid: int = 0  # uid of the previous block of the sequence that filled it
    token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        self.hash, self.uid, self.parent_uid, self.token_ids = None, 0, 0, ()


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    h = xxhash.xxh64(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self.hash_to_block: dict[int, int] = {}
        self._uids = count(1)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # Admission of a waiting sequence

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens. At least one token is always left to
        compute, since the step that samples the next token needs its logits. None for a
        sequence that scores its prompt (prompt_logprobs): those rows' logits are wanted too."""
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []
        hits: list[int] = []
        parent_hash, parent_uid = 0, 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, i)
            h = chain_hash(parent_hash, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_uid != parent_uid:
                break  # a hash collision: recompute rather than trust it
            hits.append(block_id)
            parent_hash, parent_uid = h, block.uid
        return hits

    def can_admit(self, hits: list[int], num_new_tokens: int) -> bool:
        num_cached = len(hits) * self.block_size
        new_blocks = self._blocks_needed(num_cached + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # taken from the free pool
        return new_blocks + revived <= len(self.free)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    # Growth of a scheduled sequence

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq room for num_new_tokens more tokens and register blocks they fill; False,
        changing nothing, when the free blocks cannot hold them."""
        end = seq.num_computed_tokens + num_new_tokens
        table = seq.block_table
        needed = self._blocks_needed(end) - len(table)
        if needed > 0:  # most decode steps: the last block has room
            if needed > len(self.free):
                return False
            table.extend(self._allocate() for _ in range(needed))
        # Blocks full of known tokens: a token still pending (async scheduling) is hashed a
        # step later, with the block it completes.
        full = min(end, len(seq.token_ids)) // self.block_size
        if self.enable_prefix_caching and full > seq.num_hashed_blocks:
            # Registering before the step runs lets another sequence in the same step share
            # these blocks: every token's K/V is stored before any attention reads the cache.
            self._register_full_blocks(seq, full)
        return True

    def _allocate(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.reset()
        block.ref_count = 1
        return block_id

    def _register_full_blocks(self, seq: Sequence, num_full: int) -> None:
        if num_full <= seq.num_hashed_blocks:
            return  # most decode steps: no block filled up
        parent_hash = 0
        parent_uid = 0
        if seq.num_hashed_blocks:
            parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]]
            parent_hash, parent_uid = parent.hash, parent.uid
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = self._block_tokens(seq, i)
            block.hash = chain_hash(parent_hash, block.token_ids)
            block.parent_uid = parent_uid
            block.uid = next(self._uids)
            # An equal block already cached keeps its entry; this one stays private.
            self.hash_to_block.setdefault(block.hash, block.block_id)
            parent_hash, parent_uid = block.hash, block.uid
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # Blocks whose K/V arrive from another engine (prefill/decode disaggregation)

    def allocate_blocks(self, uses: list[int]) -> list[int]:
        """Fresh blocks, block i shared by uses[i] sequences; the caller checked they fit."""
        blocks = [self._allocate() for _ in uses]
        for block_id, n in zip(blocks, uses):
            self.blocks[block_id].ref_count = n
        return blocks

    def register_imported(self, seq: Sequence) -> None:
        """Enter an imported sequence's full blocks in the prefix cache, once its K/V arrived.
        Leading blocks a sibling (n > 1) registered already are skipped: their ids stay."""
        if not self.enable_prefix_caching:
            return
        shared = 0
        while shared < len(seq.block_table) and self.blocks[seq.block_table[shared]].uid:
            shared += 1
        seq.num_hashed_blocks = shared
        self._register_full_blocks(seq, seq.num_computed_tokens // self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's: after new weights, say, when the K/V they hold is
        stale). Only when no sequence holds a block: False, and nothing forgotten, otherwise."""
        if len(self.free) != self.num_blocks:
            return False
        self.hash_to_block.clear()
        for block in self.blocks:
            block.reset()
        return True

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so that a sequence's prefix outlives its tail in the cache;
        # blocks that can never be hit go to the front of the eviction order.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if self.hash_to_block.get(block.hash) != block_id:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0
