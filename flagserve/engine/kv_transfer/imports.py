"""Decode side: an imported request waits (FCFS) until its blocks and sequence slots fit,
then its blocks are allocated and fetched on the transport's thread; once received, its
sequences join the running batch with the prompt's K/V in place and its first output (the
first token) goes out. A failed fetch frees the blocks and ends that request only, with the
error in its output. An abort during a fetch frees the blocks when the fetch ends (the
transport is writing into them until then)."""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flagserve.engine.kv_transfer.exports import check_handoff_params
from flagserve.engine.kv_transfer.handoff import KVLayout, RequestHandoff, SeqHandoff
from flagserve.engine.kv_transfer.transport import KVEndpoint, TransferDone
from flagserve.engine.outputs import FinishReason, RequestMetrics
from flagserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from flagserve.engine.llm_engine import LLMEngine


@dataclass
class Import:
    handoff: RequestHandoff
    live: list[tuple[Sequence, SeqHandoff]]  # the sequences that continue, and their handoff
    blocks: list[int]  # allocated for the transfer (empty while waiting)
    aborted: bool = False


class KVImports:
    def __init__(self, engine: LLMEngine, transport: KVEndpoint, layout: KVLayout):
        self.engine, self.transport, self.layout = engine, transport, layout
        self.waiting: deque[Import] = deque()  # for blocks
        self.fetching: dict[str, Import] = {}

    @property
    def waiting_seqs(self) -> int:
        """Sequences not yet in the batch: waiting for blocks, or for their KV to arrive."""
        return sum(len(imp.live) for imp in (*self.waiting, *self.fetching.values()))

    def add(self, h: RequestHandoff) -> None:
        self._check(h)
        e = self.engine
        seqs = []
        for s in h.seqs:
            seq = Sequence(h.request_id, s.index, list(s.token_ids), len(h.prompt_token_ids),
                           h.params, h.arrival_time, s.seed, h.priority)
            seq.generator_state, seq.logprobs = s.generator_state, s.logprobs
            seq.cumulative_logprob = s.cumulative_logprob
            seqs.append(seq)
        metrics = RequestMetrics(h.arrival_time, h.first_scheduled_time, h.first_token_time)
        state = e.new_request_state(h.request_id, h.prompt, h.prompt_token_ids, h.params, seqs, metrics)
        for seq, detok in zip(seqs, state.detokenizers):
            e.check_stop(seq, detok, seq.token_ids[-1])  # as the prefill side did: same verdict
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
        live = [(seq, s) for seq, s in zip(seqs, h.seqs) if not seq.is_finished]
        imp = Import(h, live, [])
        if e.args.scheduling_policy == "priority":  # in (priority, arrival) order, as the scheduler's
            at = bisect.bisect_right(self.waiting, _order(imp), key=_order)
            self.waiting.insert(at, imp)
        else:
            self.waiting.append(imp)

    def _check(self, h: RequestHandoff) -> None:
        e = self.engine
        if h.request_id in e.requests:
            raise ValueError(f"request id {h.request_id!r} is already in use")
        if h.layout != self.layout:
            raise ValueError(f"the prefill engine's KV layout {h.layout} differs from this "
                             f"engine's {self.layout}: same model, dtype and block_size needed")
        if h.num_blocks > e.block_manager.num_blocks:
            raise ValueError(f"request {h.request_id!r} needs {h.num_blocks} KV blocks, this "
                             f"engine has {e.block_manager.num_blocks}")
        if len(h.seqs) > e.args.max_num_seqs:  # its sequences join the batch together
            raise ValueError(f"request {h.request_id!r} has n={len(h.seqs)} sequences, more than "
                             f"this decode engine's max_num_seqs={e.args.max_num_seqs}: lower n, "
                             "or raise the decode role's max_num_seqs")
        if len(h.seqs[0].token_ids) >= e.max_model_len:
            raise ValueError(f"request {h.request_id!r} has {len(h.seqs[0].token_ids)} tokens, "
                             f"max_model_len is {e.max_model_len}")
        h.params.validate()
        h.params.check_vocab(e.model_config.vocab_size)
        check_handoff_params(h.params)

    def admit(self) -> None:
        """Start the fetches of waiting imports, in order, while their blocks fit."""
        e = self.engine
        bm = e.block_manager
        while self.waiting:
            imp = self.waiting[0]
            slots = len(e.scheduler.running) + sum(len(i.live) for i in self.fetching.values())
            if imp.handoff.num_blocks > bm.num_free_blocks \
                    or slots + len(imp.live) > e.args.max_num_seqs:
                return
            self.waiting.popleft()
            imp.blocks = bm.allocate_blocks(imp.handoff.block_uses)
            for seq, s in imp.live:
                seq.block_table = [imp.blocks[i] for i in s.block_indices]
            self.fetching[imp.handoff.request_id] = imp
            self.transport.fetch(imp.handoff.request_id, imp.handoff.source, imp.blocks)

    def on_done(self, done: TransferDone) -> str | None:
        """The request with new outputs (its first token, or its error), if any."""
        imp = self.fetching.pop(done.request_id, None)
        if imp is None:
            return None
        e = self.engine
        if imp.aborted or done.error is not None:
            for seq, _ in imp.live:
                e.block_manager.free_sequence(seq)
                seq.finish_reason, seq.status = FinishReason.ABORT, SequenceStatus.FINISHED
            if imp.aborted:
                return None
            e.requests[done.request_id].error = done.error
            return done.request_id
        for seq, s in imp.live:
            seq.num_computed_tokens = imp.handoff.num_computed_tokens
            seq.num_cached_tokens = s.num_cached_tokens
            e.block_manager.register_imported(seq)
            e.scheduler.resume(seq)
        return done.request_id

    def drop(self, request_id: str) -> bool:
        """Abort: True if request_id had not joined the batch yet (nothing else to undo)."""
        imp = self.fetching.get(request_id)
        if imp is not None:
            imp.aborted = True  # the blocks are freed when the fetch ends
        else:
            imp = next((i for i in self.waiting if i.handoff.request_id == request_id), None)
            if imp is None:
                return False
            self.waiting.remove(imp)
        for seq, _ in imp.live:
            seq.finish_reason, seq.status = FinishReason.ABORT, SequenceStatus.FINISHED
        return True


def _order(imp: Import) -> tuple[int, float]:
    return imp.handoff.priority, imp.handoff.arrival_time
