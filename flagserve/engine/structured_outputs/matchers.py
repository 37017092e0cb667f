"""The engine's side of structured outputs: requests wait for their grammar, then every
constrained sequence has a matcher that follows its output tokens.

A matcher's state is a function of the sequence's output tokens, never of the KV cache, so
chunked prefill, prefix caching and preemption by recompute (which keeps the generated tokens)
leave it valid; sync() replays whatever tokens it has not seen, and rebuilds from the start
when it has seen more than the sequence holds, so it always matches the tokens so far. Each of
n > 1 samples has its own matcher.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flagserve.engine.sequence import Sequence
from flagserve.engine.structured_outputs.compiler import GrammarCompiler

Advance = Literal["ok", "terminated", "rejected"]


@dataclass
class _Held:
    future: Future
    seqs: list[Sequence]


@dataclass
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has consumed
    pending: list[int] = field(default_factory=list)  # queued for the next mask's job
    rejected: bool = False  # the job found the last token outside the grammar

    @property
    def num_seen(self) -> int:
        return self.num_accepted + len(self.pending)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self._stop_ids = frozenset(stop_token_ids)  # the tokens that end a grammar
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._held: dict[str, _Held] = {}  # request id -> its sequences, until the grammar is ready
        self.matchers: dict[int, _Matcher] = {}  # seq_id -> matcher
        self._mask: torch.Tensor | None = None  # reused across steps: allocating costs per step
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher
        # The fill runs beside the model forward (xgrammar releases the GIL): the mask is only
        # needed at sampling. One fill at a time: the next step's reuses the buffer.
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._filling: Future | None = None

    # Requests waiting for their grammar

    def hold(self, request_id: str, seqs: list[Sequence]) -> None:
        self._held[request_id] = _Held(self.compiler.submit(seqs[0].params.structured_outputs), seqs)

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted); True when it was held."""
        return self._held.pop(request_id, None) is not None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready or `timeout`: for a step with nothing else to run."""
        wait([h.future for h in self._held.values()], timeout, FIRST_COMPLETED)

    def release(self) -> tuple[list[Sequence], list[tuple[str, BaseException]]]:
        """Sequences whose grammar is ready (their matchers made), and (request id, error) of
        those whose compilation failed."""
        ready, failed = [], []
        for request_id, held in list(self._held.items()):
            if not held.future.done():
                continue
            del self._held[request_id]
            if held.future.exception() is not None:
                failed.append((request_id, held.future.exception()))
                continue
            import xgrammar as xgr
            for seq in held.seqs:
                self.matchers[seq.seq_id] = _Matcher(xgr.GrammarMatcher(held.future.result()))
            ready.extend(held.seqs)
        return ready, failed

    # Constrained sequences

    def sync(self, seq: Sequence) -> Advance:
        """Bring the sequence's matcher up to its output tokens, now (pending ones included)."""
        m = self.matchers[seq.seq_id]
        out = seq.output_token_ids
        m.pending.clear()
        if m.num_accepted > len(out):
            m.matcher.reset()
            m.num_accepted = 0
        for token in out[m.num_accepted:]:
            if not m.matcher.accept_token(token):
                return "rejected"
            m.num_accepted += 1
        return "terminated" if m.matcher.is_terminated() else "ok"

    def advance_all(self, seqs: list[Sequence]) -> list[Advance | None]:
        """After each sequence got its new token: where its grammar stands (None when
        unconstrained). The usual token is only queued: the next mask's job accepts it beside
        the forward. It came through the mask, so it ends the grammar exactly when it is a stop
        token; a matcher that rejected its last token (a bug) is reported one step late."""
        self._wait_fill()  # normally done: the sampler waited for it
        results: list[Advance | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            m = self.matchers.get(seq.seq_id)
            if m is None:
                continue
            if m.rejected:
                results[i] = "rejected"
            elif m.num_seen == seq.num_output_tokens - 1:
                token = seq.token_ids[-1]
                m.pending.append(token)
                results[i] = "terminated" if token in self._stop_ids else "ok"
            else:
                results[i] = self.sync(seq)
        return results

    def bitmask(self, seqs: list[Sequence]) -> Future[torch.Tensor] | None:
        """[len(seqs), ceil(vocab / 32)] int32 allowed-token bits for the rows that sample,
        all ones for unconstrained rows; None when no row is constrained. A background job
        accepts the queued tokens, then fills the rows; the matchers are not to be touched
        until it is done."""
        rows = [(i, self.matchers[s.seq_id]) for i, s in enumerate(seqs) if s.seq_id in self.matchers]
        if not rows:
            return None
        import xgrammar as xgr
        self._wait_fill()
        if self._mask is None or self._mask.shape[0] < len(seqs):
            self._mask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
            self._batch = xgr.BatchGrammarMatcher()
        mask = self._mask[:len(seqs)]
        mask.fill_(-1)  # all ones: unconstrained rows allow everything
        for i, m in rows:
            if m.num_seen != seqs[i].num_output_tokens:  # preempted and recomputed, or new
                self.sync(seqs[i])
        self._filling = self._filler.submit(self._accept_and_fill, [m for _, m in rows], mask,
                                            [i for i, _ in rows])
        return self._filling

    def _accept_and_fill(self, matchers: list[_Matcher], mask: torch.Tensor, rows: list[int]
                         ) -> torch.Tensor:
        behind = [m for m in matchers if m.pending]
        if behind:  # one token each, as advance_all queues them
            accepted = self._batch.batch_accept_token([m.matcher for m in behind],
                                                      [m.pending[0] for m in behind])
            for m, ok in zip(behind, accepted):
                m.num_accepted += ok
                m.rejected = not ok
                m.pending.clear()
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], mask, rows)
        return mask

    def _wait_fill(self) -> None:
        if self._filling is not None:
            wait([self._filling])
            self._filling = None

    def forget(self, seq: Sequence) -> None:
        self._wait_fill()
        self.matchers.pop(seq.seq_id, None)

    def shutdown(self) -> None:
        self._filler.shutdown(wait=True)
        self.compiler.shutdown()
