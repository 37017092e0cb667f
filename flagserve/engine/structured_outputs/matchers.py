"""The engine's side of structured outputs: requests wait for their grammar, then every
constrained sequence has a matcher (in the grammar process, worker.py) that follows its
output tokens and fills its row of each step's token bitmask.

A matcher's state is a function of the sequence's output tokens, never of the KV cache, so
chunked prefill, prefix caching and preemption by recompute (which keeps the generated tokens)
leave it valid; a sequence whose token count the matcher does not expect has it reset and
replayed, so it always matches the tokens so far. Each of n > 1 samples has its own matcher.
The usual new token is not sent at once: it goes with the next step's job, which accepts it
and fills the mask while the engine runs the forward.
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


@dataclass
class MaskJob:
    """A step's token bitmask, being filled by the grammar process."""
    process: GrammarProcess
    job: int
    num_rows: int

    def result(self) -> torch.Tensor:
        self.process.wait(self.job, self.num_rows)
        return self.process.mask[:self.num_rows]


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
                m.pending, m.num_seen = token, m.num_seen + 1
            else:
                self._reset(seq, m)
            results[i] = "terminated" if token in self.stop_token_ids else "ok"
        return results

    def _reset(self, seq: Sequence, m: _Matcher) -> None:
        """Preempted and recomputed, or seen more than it holds: replayed from the start."""
        self._ops.append(("reset", seq.seq_id, list(seq.output_token_ids)))
        m.num_seen, m.pending = seq.num_output_tokens, None

    def bitmask(self, seqs: list[Sequence]) -> MaskJob | None:
        """[len(seqs), ceil(vocab / 32)] int32 allowed-token bits for the rows that sample,
        all ones for unconstrained rows; None when no row is constrained. Filled by the
        grammar process while the forward runs: result() waits for it."""
        fill_rows = [i for i, s in enumerate(seqs) if s.seq_id in self.matchers]
        if not fill_rows:
            return None
        if len(seqs) > self.max_rows:
            raise ValueError(f"{len(seqs)} sampled rows, more than the mask's {self.max_rows}")
        fill_ids, accept_ids, accept_tokens = [], [], []
        for i in fill_rows:
            seq = seqs[i]
            m = self.matchers[seq.seq_id]
            if m.num_seen != seq.num_output_tokens:
                self._reset(seq, m)
            elif m.pending is not None:
                accept_ids.append(seq.seq_id)
                accept_tokens.append(m.pending)
                m.pending = None
            fill_ids.append(seq.seq_id)
        ops, self._ops = self._ops, []
        job = self.process.submit(Step(0, len(seqs), ops, (accept_ids, accept_tokens),
                                        (fill_rows, fill_ids)))
        return MaskJob(self.process, job, len(seqs))

    def forget(self, seq: Sequence) -> None:
        if self.matchers.pop(seq.seq_id, None) is not None:
            self._ops.append(("forget", seq.seq_id))
            self._rejected.discard(seq.seq_id)

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.close()
