"""A step's model inputs in static buffers: allocated once, filled with numpy, copied once.

CUDA graphs replay on fixed addresses, so token ids, positions, slot mapping, block tables,
sequence lengths and logits rows live in buffers sized for the largest step, and a step uses
a prefix of each. On CUDA numpy fills pinned host mirrors and each buffer gets one
non_blocking copy; on CPU numpy writes the buffers themselves.

A decode-only step may be padded to a bucket size (the sizes graphs are captured for):
padded rows have token 0 at position 0, slot -1 (the KV store skips negative slots), a
sequence length of 1 over block 0, and no logits row, so they touch nothing real.
"""
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from flagserve.engine.step_input import StepInput
from flagserve.layers.attention_metadata import AttentionMetadata

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8  # past 8 rows: every multiple of 8, so padding wastes under 8 rows


def decode_buckets(max_rows: int) -> list[int]:
    """Padded decode batch sizes up to max_rows (max_rows itself always one of them)."""
    sizes = {b for b in SMALL_BUCKETS if b < max_rows}
    sizes.update(range(2 * BUCKET_STEP, max_rows, BUCKET_STEP))
    return sorted(sizes | {max_rows})


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `rows`, None past the largest."""
    return next((b for b in buckets if b >= rows), None)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    num_tokens: int  # the step's real tokens: rows past them are padding
    padded: bool  # decode rows padded to a bucket (maybe by none): the graph-shaped path
    pending_positions: torch.Tensor | None = None  # input_ids rows to take from the last samples
    pending_rows: torch.Tensor | None = None  # ... and which of those samples

    def take_pending(self, samples: torch.Tensor) -> None:
        """Input tokens sampled by the step before, copied on the device (async scheduling)."""
        if self.pending_positions is not None:
            self.input_ids[self.pending_positions] = samples[self.pending_rows].to(self.input_ids.dtype)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


# name -> (dtype, capacity key): "tokens" rows, "seqs" rows, "seqs+1", or "table" (seqs x width)
FIELDS = {
    "input_ids": (torch.long, "tokens"),
    "positions": (torch.long, "tokens"),
    "slot_mapping": (torch.long, "tokens"),
    "logits_indices": (torch.long, "seqs"),
    "seq_lens": (torch.int32, "seqs"),
    "cu_seqlens_q": (torch.int32, "seqs+1"),
    "block_tables": (torch.int32, "table"),  # flat: a step views its prefix as [rows, width]
    "decode_order": (torch.int32, "seqs"),  # AttentionMetadata's, where the kernel takes one
    "pending_positions": (torch.long, "seqs"),  # async scheduling: StepInput's fields of the name
    "pending_rows": (torch.long, "seqs"),
}


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, order_decodes: bool = False):
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.order_decodes = order_decodes
        sizes = {"tokens": max_tokens, "seqs": max_seqs, "seqs+1": max_seqs + 1,
                 "table": max_seqs * max_blocks_per_seq}
        pinned = device.type == "cuda"
        self.device_bufs: dict[str, torch.Tensor] = {}
        self.pinned: dict[str, torch.Tensor] = {}  # CUDA: the host mirrors, copy sources
        self.host: dict[str, np.ndarray] = {}  # what numpy writes: the mirrors, or on CPU the buffers
        for name, (dtype, key) in FIELDS.items():
            buf = torch.zeros(sizes[key], dtype=dtype, device=device)
            host = torch.zeros(sizes[key], dtype=dtype, pin_memory=True) if pinned else buf
            self.device_bufs[name], self.host[name] = buf, host.numpy()
            if pinned:
                self.pinned[name] = host
        # Until a step writes them: what a padded row holds (a capture may read any row).
        self.host["slot_mapping"][:] = -1
        self.host["seq_lens"][:] = 1
        self.host["decode_order"][:] = np.arange(max_seqs)
        # Set after each step's copies: the next fill must not overwrite pinned memory that a
        # copy still reads (pipeline stages other than the last never wait for the GPU).
        self.copied = torch.cuda.Event() if pinned else None
        self._upload({name: len(host) for name, host in self.host.items()})
        self._rows = np.arange(max_seqs)  # a decode-only step's sequence of each token
        # The views of a step's prefixes, by their sizes: a batch of the same sizes as an
        # earlier one reads the same addresses, and building nine views and the metadata cost
        # ~25 us a step (a third of a batch-1 fill).
        self._batches: dict[tuple, PreparedBatch] = {}

    def fill(self, step: StepInput, pad_to: int | None = None) -> PreparedBatch:
        """The step's inputs. pad_to: a decode-only step padded to that many rows, its block
        tables at full width (a graph's shapes are fixed); else exact rows and width."""
        if self.copied is not None:
            self.copied.synchronize()
        num_new = np.asarray(step.num_new_tokens, dtype=np.int64)
        n = len(num_new)
        rows = pad_to or n  # sequences; padded steps are decode-only: one token per sequence
        lens = list(map(len, step.block_tables))
        width = self.max_blocks if pad_to else max(lens)
        ones = int(np.count_nonzero(num_new == 1))
        decode_only = ones == n  # one new token per sequence: no prefix sums needed
        tables = self._fill_tables(step.block_tables, lens, rows, width)
        self._fill_tokens(step, num_new, tables, pad_to or step.num_tokens, decode_only)
        self.host["seq_lens"][n:rows] = 1
        num_decodes = pad_to or ones  # decodes come first
        whole_prompts = num_decodes == 0 and not any(step.start_positions)
        if self.order_decodes:  # longest first; padded rows (length 1) last
            self.host["decode_order"][:num_decodes] = np.argsort(
                -self.host["seq_lens"][:num_decodes], kind="stable")
        num_prefills = n - num_decodes if not pad_to else 0
        cu = self.host["cu_seqlens_q"]
        cu[0] = 0
        if num_prefills:
            cu[1:num_prefills + 1] = np.cumsum(num_new[n - num_prefills:])
        k = len(step.sample_indices)
        # a sampled sequence's logits row is its last token's: its own row when all are decodes
        self.host["logits_indices"][:k] = (step.sample_indices if decode_only
                                           else np.cumsum(num_new)[step.sample_indices] - 1)
        pending = len(step.pending_positions)
        self.host["pending_positions"][:pending] = step.pending_positions
        self.host["pending_rows"][:pending] = step.pending_rows
        used = self._used(pad_to or step.num_tokens, rows, width, num_prefills, k, pending,
                          num_decodes if self.order_decodes else 0)
        self._upload(used)
        return self._batch(used, num_decodes, width, step.num_tokens, bool(pad_to), whole_prompts)

    def _fill_tables(self, tables: list[list[int]], lens: list[int], rows: int, width: int) -> np.ndarray:
        """[rows, width] block tables, zero past each sequence's blocks and in padded rows."""
        out = self.host["block_tables"][:rows * width].reshape(rows, width)
        row_lens = np.zeros(rows, dtype=np.int64)
        row_lens[:len(lens)] = lens
        out[:] = 0
        out[np.arange(width) < row_lens[:, None]] = np.fromiter(
            chain.from_iterable(tables), dtype=np.int32, count=sum(lens))
        return out

    def _fill_tokens(self, step: StepInput, num_new: np.ndarray, tables: np.ndarray,
                     rows: int, decode_only: bool) -> None:
        h, bs, t = self.host, self.block_size, step.num_tokens
        starts = np.asarray(step.start_positions, dtype=np.int64)
        if decode_only:  # one token per sequence, at its start position
            pos, seq = starts, self._rows[:t]
        else:
            first_row = np.cumsum(num_new) - num_new
            pos = np.arange(t) + np.repeat(starts - first_row, num_new)
            seq = np.repeat(np.arange(len(num_new)), num_new)
        h["input_ids"][:t] = step.token_ids
        h["positions"][:t] = pos
        h["slot_mapping"][:t] = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
        h["input_ids"][t:rows] = 0
        h["positions"][t:rows] = 0
        h["slot_mapping"][t:rows] = -1
        h["seq_lens"][:len(num_new)] = starts + num_new

    @staticmethod
    def _used(tokens: int, rows: int, width: int, num_prefills: int, logits: int,
              pending: int = 0, ordered: int = 0) -> dict[str, int]:
        """How much of each buffer a step uses (a prefix of each)."""
        return {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens,
                "logits_indices": logits, "seq_lens": rows, "cu_seqlens_q": num_prefills + 1,
                "block_tables": rows * width, "decode_order": ordered,
                "pending_positions": pending, "pending_rows": pending}

    def _upload(self, used: dict[str, int]) -> None:
        if self.copied is None:
            return  # on CPU numpy wrote the buffers themselves
        for name, count in used.items():
            if count:
                self.device_bufs[name][:count].copy_(self.pinned[name][:count], non_blocking=True)
        self.copied.record()

    def _batch(self, used: dict[str, int], num_decodes: int, width: int, num_tokens: int,
               padded: bool, whole_prompts: bool = False) -> PreparedBatch:
        key = (*used.values(), num_decodes, width, num_tokens, padded, whole_prompts)
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= 1024:  # tables widen as sequences grow: keep it bounded
                self._batches.clear()
            batch = self._batches[key] = self._new_batch(used, num_decodes, width, num_tokens,
                                                         padded, whole_prompts)
        return batch

    def _new_batch(self, used: dict[str, int], num_decodes: int, width: int, num_tokens: int,
                   padded: bool, whole_prompts: bool) -> PreparedBatch:
        views = {name: self.device_bufs[name][:count] for name, count in used.items()}
        meta = AttentionMetadata(num_decode_tokens=num_decodes, slot_mapping=views["slot_mapping"],
                                 seq_lens=views["seq_lens"],
                                 block_tables=views["block_tables"].view(-1, width),
                                 cu_seqlens_q=views["cu_seqlens_q"],
                                 decode_order=views["decode_order"] if used["decode_order"] else None,
                                 whole_prompts=whole_prompts)
        pending = (None, None)
        if used["pending_rows"]:
            pending = (views["pending_positions"], views["pending_rows"])
        return PreparedBatch(views["input_ids"], views["positions"], meta, views["logits_indices"],
                             num_tokens, padded, *pending)

    def padded_batch(self, rows: int) -> PreparedBatch:
        """The inputs of a padded decode step of `rows` rows as they stand (what a graph reads)."""
        used = self._used(rows, rows, self.max_blocks, 0, 0, 0, rows if self.order_decodes else 0)
        return self._batch(used, rows, self.max_blocks, rows, True)
