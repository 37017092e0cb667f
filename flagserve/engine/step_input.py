"""The one message per step from the scheduler to the model: plain lists, cheap to pickle.

The same StepInput drives the in-process runner and every shard worker, so neither needs
Sequence objects. Sampling state that lasts (params, seed, prompt ids for penalties) is sent
once, the first time a sequence is scheduled, and dropped when the engine reports it finished:
the runner that samples keeps it, with the seeded generator, across preemptions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from flagserve.engine.prompt_logprobs import PromptRows, prompt_rows
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.scheduler import ScheduledBatch
from flagserve.engine.sequence import Sequence


class PendingMask(Protocol):
    def result(self) -> torch.Tensor: ...  # waits until the mask is filled


@dataclass
class NewSeq:
    seq_id: int
    params: SamplingParams
    seed: int | None  # the sequence's own seed (request seed, or derived for n > 1)
    prompt_token_ids: list[int] | None  # only when penalties need them
    generator_state: bytes | None = None  # resumes an imported sequence's random stream


@dataclass
class StepInput:
    # Per scheduled sequence, decodes (one new token) first.
    seq_ids: list[int]
    num_new_tokens: list[int]
    start_positions: list[int]  # tokens already in the cache: the first new token's position
    block_tables: list[list[int]]
    token_ids: list[int]  # the new tokens of every sequence, concatenated
    # Per sequence that samples (its chunk reaches its last token), in batch order.
    sample_indices: list[int]  # index into the sequences above
    num_output_tokens: list[int]  # for min_tokens
    output_token_ids: list[list[int]] | None  # when a sampled row reads its output (penalties, bad words)
    new_seqs: list[NewSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # Per sampled row: allowed-token bits of its grammar (all ones when unconstrained); None
    # when no row is constrained. The grammar process writes it, while the forward runs.
    token_bitmask: torch.Tensor | PendingMask | None = None
    # Async scheduling: new tokens sampled by the step before and not yet on the host. Their
    # places in token_ids (which hold 0 there) and their rows among that step's samples.
    pending_positions: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    # Prefill rows whose logits score the prompt's next tokens (prompt_logprobs)
    prompt_rows: list[PromptRows] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def grammar_bitmask(self) -> torch.Tensor | None:
        """The token bitmask, once its fill is done."""
        mask = self.token_bitmask
        return mask if mask is None or isinstance(mask, torch.Tensor) else mask.result()

    def __getstate__(self) -> dict:
        # Shard workers get a copy of the finished mask: the job does not cross processes,
        # and its shared memory is the next job's.
        mask = self.grammar_bitmask()
        return {**self.__dict__, "token_bitmask": None if mask is None else mask.clone()}


class StepInputBuilder:
    """Engine side: turns a ScheduledBatch into a StepInput, remembering what runners know."""

    def __init__(self, async_scheduling: bool = False) -> None:
        self._known: dict[int, bool] = {}  # seq_id -> whether its sampling reads its output
        self._finished: list[int] = []
        self._async = async_scheduling
        self._sample_rows: dict[int, int] = {}  # seq_id -> its row among the last step's samples

    def build(self, batch: ScheduledBatch) -> StepInput:
        step = StepInput([], [], [], [], [], [], [], None, [], self._finished)
        self._finished = []
        known, token_ids, sample_indices = self._known, step.token_ids, step.sample_indices
        reads_output = False
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            reads = known.get(seq.seq_id)
            if reads is None:
                reads = known[seq.seq_id] = seq.params.needs_output_tokens
                prompt = seq.token_ids[:seq.num_prompt_tokens] if seq.params.has_penalties else None
                step.new_seqs.append(NewSeq(seq.seq_id, seq.params, seq.seed, prompt,
                                            seq.generator_state))
            start = seq.num_computed_tokens
            step.seq_ids.append(seq.seq_id)
            step.start_positions.append(start)
            step.block_tables.append(seq.block_table)
            if start + n == seq.num_tokens:  # the chunk reaches its last token: it samples
                sample_indices.append(i)
                step.num_output_tokens.append(start + n - seq.num_prompt_tokens)
                reads_output = reads_output or reads
            if seq.prompt_logprobs is not None and (rows := prompt_rows(seq, start, n, len(token_ids))):
                step.prompt_rows.append(rows)
            if seq.num_pending and start + n > len(seq.token_ids):
                self._pending_token(step, seq, start, n)
            elif n == 1:
                token_ids.append(seq.token_ids[start])
            else:
                token_ids.extend(seq.token_ids[start:start + n])
        step.num_new_tokens.extend(batch.num_new_tokens)
        if reads_output:
            step.output_token_ids = [batch.seqs[i].output_token_ids for i in sample_indices]
        if self._async:
            self._sample_rows = {step.seq_ids[i]: row for row, i in enumerate(sample_indices)}
        return step

    def _pending_token(self, step: StepInput, seq: Sequence, start: int, n: int) -> None:
        """The chunk's tokens where the last is still on the device: a slot for it, filled
        from the previous step's samples (the only step a token can be pending from)."""
        if n > 1:
            step.token_ids.extend(seq.token_ids[start:start + n - 1])
        step.pending_positions.append(len(step.token_ids))
        step.pending_rows.append(self._sample_rows[seq.seq_id])
        step.token_ids.append(0)

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: runners may forget it with the next step."""
        if self._known.pop(seq.seq_id, None) is not None:
            self._finished.append(seq.seq_id)
