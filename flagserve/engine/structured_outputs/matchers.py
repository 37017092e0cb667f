"""The engine's side of structured outputs: requests wait for their grammar, then every
constrained sequence has a matcher (in the grammar process, worker.py) that follows its
output tokens and fills its row of each step's token bitmask.

A matcher's state is a function of the sequence's output tokens, never of the KV cache, so
chunked prefill, prefix caching and preemption by recompute (which keeps the generated tokens)
leave it valid; a sequence whose token count the matcher does not expect has it reset and
replayed, so it always matches the tokens so far. Each of n > 1 samples has its own matcher.

A step's new tokens go to the grammar process as soon as they are known, in a job that
accepts them and fills those sequences' next masks: it runs while the engine finishes the
step (stop checks, outputs) and schedules, builds and runs the next one, where a job sent
with the next step had only that step's forward beside it and, for a small model, kept the
sampler waiting. The next step's own job fills only the rows that one did not (new, reset or
resumed sequences).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch

from flagserve.engine.sequence import Sequence
from flagserve.engine.structured_outputs.process import GrammarProcess
from flagserve.engine.structured_outputs.worker import (
    Compile,
    Compiled,
    Rejected,
    Start,
    Step,
    weakly_ordered,
)

Advance = Literal["ok", "terminated", "rejected"]


@dataclass
class _Held:
    hold_id: int
    seqs: list[Sequence]


@dataclass
class _Matcher:  # the engine's view of a matcher in the grammar process
    num_seen: int = 0  # output tokens sent to it, or queued for the next job
    pending: int | None = None  # the token queued for the next job
    # The job that filled its mask after num_seen tokens (None: none since) and the mask's
    # row among that job's fills.
    mask_job: int | None = None
    mask_row: int = 0


@dataclass
class MaskJob:
    """A step's token bitmask, being filled by the grammar process: all ones, and per job
    the rows it filled (`take`, among its fills) for the step's rows `put`."""
    process: GrammarProcess
    num_rows: int
    parts: list[tuple[int, list[int], list[int]]]  # (job, take, put)

    def result(self) -> torch.Tensor:
        if len(self.parts) == 1 and len(self.parts[0][2]) == self.num_rows:
            # Every row from one job (the usual decode step): its rows as they are, or
            # gathered; put is then every row in order.
            job, take, _ = self.parts[0]
            rows = self.process.masks(job)
            return rows if take == list(range(len(rows))) else rows[torch.tensor(take)]
        out = torch.full((self.num_rows, self.process.mask.shape[1]), -1, dtype=torch.int32)
        for job, take, put in self.parts:
            out[put] = self.process.masks(job)[take]
        return out


@dataclass
class StructuredOutputs:
    tokenizer: str  # what load_tokenizer() takes: the grammar process loads its own
    vocab_size: int
    stop_token_ids: list[int]  # the tokens that end a grammar
    max_rows: int  # sampled rows in a step, at most
    matchers: dict[int, _Matcher] = field(default_factory=dict)  # seq_id -> matcher
    compile_requests: int = 0  # the compiler's counters, as last reported
    cache_hits: int = 0
    process: GrammarProcess | None = None  # the grammar process, started by the first constrained request
    _held: dict[str, _Held] = field(default_factory=dict)  # request id -> its grammar's sequences
    _compiled: dict[int, str | None] = field(default_factory=dict)  # hold id -> error, when done
    _rejected: set[int] = field(default_factory=set)
    _ops: list[tuple] = field(default_factory=list)  # matcher changes for the next job
    _hold_ids: itertools.count = field(default_factory=itertools.count)

    # Requests waiting for their grammar

    def hold(self, request_id: str, seqs: list[Sequence]) -> None:
        if self.process is None:
            self.process = GrammarProcess(Start(self.tokenizer, self.vocab_size,
                                                 list(self.stop_token_ids), self.max_rows,
                                                 weakly_ordered()))
        params = seqs[0].params.structured_outputs
        held = self._held[request_id] = _Held(next(self._hold_ids), seqs)
        self.process.send(Compile(held.hold_id, params.kind, params.spec()))

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted); True when it was held."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._ops.append(("unhold", held.hold_id))
            self._compiled.pop(held.hold_id, None)
        return held is not None

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def held_seqs(self) -> int:
        """Sequences waiting for their grammar (counted as waiting, as vLLM counts them)."""
        return sum(len(held.seqs) for held in self._held.values())

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready or `timeout`: for a step with nothing else to run."""
        if self.process is not None:
            self._receive(timeout)

    def release(self) -> tuple[list[Sequence], list[tuple[str, str]]]:
        """Sequences whose grammar is ready (their matchers made with the next job), and
        (request id, error) of those whose compilation failed."""
        if not self._held:
            return [], []
        self._receive(force=True)  # a dead process is noticed here too, not only by an idle wait
        ready, failed = [], []
        for request_id, held in list(self._held.items()):
            if held.hold_id not in self._compiled and self.process.error is None:
                continue
            del self._held[request_id]
            error = self._compiled.pop(held.hold_id, self.process.error)
            if error is not None:
                failed.append((request_id, error))
                continue
            for seq in held.seqs:
                self.matchers[seq.seq_id] = _Matcher()
                self._ops.append(("new", seq.seq_id, held.hold_id))
            self._ops.append(("unhold", held.hold_id))
            ready.extend(held.seqs)
        return ready, failed

    def _receive(self, timeout: float = 0.0, force: bool = False) -> None:
        for msg in self.process.receive(timeout, force):
            if isinstance(msg, Compiled):
                self._compiled[msg.hold_id] = msg.error
                self.compile_requests, self.cache_hits = msg.requests, msg.cache_hits
            elif isinstance(msg, Rejected):
                self._rejected.update(msg.seq_ids)

    # Constrained sequences

    def advance_all(self, seqs: list[Sequence]) -> list[Advance | None]:
        """After each sequence got its new token: where its grammar stands (None when
        unconstrained). The token came through the mask, so it ends the grammar exactly when
        it is a stop token; a matcher that rejected a token (a bug) is reported after the
        job that found it."""
        results: list[Advance | None] = [None] * len(seqs)
        if not self.matchers:
            return results
        self._receive()  # rejections, sent before the job's counter
        for i, seq in enumerate(seqs):
            m = self.matchers.get(seq.seq_id)
            if m is None:
                continue
            if seq.seq_id in self._rejected:
                results[i] = "rejected"
                continue
            token = seq.token_ids[-1]
            if m.pending is None and m.num_seen == seq.num_output_tokens - 1:
                m.pending, m.num_seen, m.mask_job = token, m.num_seen + 1, None
            else:
                self._reset(seq, m)
            results[i] = "terminated" if token in self.stop_token_ids else "ok"
        self._submit([s for s, r in zip(seqs, results) if r == "ok"])
        return results

    def _reset(self, seq: Sequence, m: _Matcher) -> None:
        """Preempted and recomputed, or seen more than it holds: replayed from the start."""
        self._ops.append(("reset", seq.seq_id, list(seq.output_token_ids)))
        m.num_seen, m.pending, m.mask_job = seq.num_output_tokens, None, None

    def _submit(self, seqs: list[Sequence]) -> int:
        """A job that accepts the sequences' pending tokens and fills their next masks (after
        the matcher changes so far); its number, or 0 for no sequences."""
        if not seqs:
            return 0
        accept_ids, accept_tokens = [], []
        for seq in seqs:
            m = self.matchers[seq.seq_id]
            if m.pending is not None:
                accept_ids.append(seq.seq_id)
                accept_tokens.append(m.pending)
                m.pending = None
        ops, self._ops = self._ops, []
        fill = [seq.seq_id for seq in seqs]
        job = self.process.submit(Step(0, ops, (accept_ids, accept_tokens), fill))
        for row, seq_id in enumerate(fill):
            m = self.matchers[seq_id]
            m.mask_job, m.mask_row = job, row
        return job

    def bitmask(self, seqs: list[Sequence]) -> MaskJob | None:
        """[len(seqs), ceil(vocab / 32)] int32 allowed-token bits for the rows that sample,
        all ones for unconstrained rows; None when no row is constrained. Filled by the
        grammar process (since the last step's tokens, or while the forward runs): result()
        waits for it. Only the masks of the last job are taken as they are: the job sent now
        fills the areas of the one before it."""
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.matchers]
        if not rows:
            return None
        if len(seqs) > self.max_rows:
            raise ValueError(f"{len(seqs)} sampled rows, more than the mask's {self.max_rows}")
        last = self.process.last_job
        take, put, fill, fill_rows = [], [], [], []
        for i in rows:
            seq = seqs[i]
            m = self.matchers[seq.seq_id]
            if m.num_seen != seq.num_output_tokens:
                self._reset(seq, m)
            elif m.pending is None and m.mask_job == last:
                take.append(m.mask_row)
                put.append(i)
                continue
            fill.append(seq)
            fill_rows.append(i)
        parts = [(last, take, put)] if take else []
        if fill:
            parts.append((self._submit(fill), list(range(len(fill))), fill_rows))
        return MaskJob(self.process, len(seqs), parts)

    def forget(self, seq: Sequence) -> None:
        if self.matchers.pop(seq.seq_id, None) is not None:
            self._ops.append(("forget", seq.seq_id))
            self._rejected.discard(seq.seq_id)

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.close()
