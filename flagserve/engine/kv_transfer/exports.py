"""Prefill side: a request marked for handoff runs its prompt as usual (chunks, prefix hits);
each sequence is parked after its first token (off the running batch, blocks kept). Once all
of its sequences are parked or finished, its blocks are offered on the transport, a
RequestHandoff is queued for take(), and the request leaves the engine: it has no outputs
here. The blocks are freed when the transport reports them read, expired or withdrawn
(abort); cached prefix blocks then stay findable as for any finished sequence."""
from __future__ import annotations

from typing import TYPE_CHECKING

from flagserve.engine.kv_transfer.handoff import KVLayout, RequestHandoff, SeqHandoff
from flagserve.engine.kv_transfer.transport import KVEndpoint, TransferDone
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from flagserve.engine.llm_engine import LLMEngine, RequestState
    from flagserve.engine.model_runner import ModelRunner


def check_handoff_params(params: SamplingParams) -> None:
    # Named as a client sends them: the HTTP API turns response_format and forced tool calls
    # into structured_outputs, echo with logprobs into prompt_logprobs.
    # "SamplingParams.<field>": the HTTP error names the field (errors.request_error)
    if params.structured_outputs is not None:  # the decode side would need the matcher's state
        raise ValueError("SamplingParams.structured_outputs (also response_format, and "
                         "tool_choice required or a named function) are not supported with "
                         "prefill/decode disaggregation yet; send the request to an aggregated "
                         "engine")
    if params.prompt_logprobs is not None:  # scored on the prefill side, never handed over
        raise ValueError("SamplingParams.prompt_logprobs (also echo with logprobs) are not "
                         "supported with prefill/decode disaggregation yet; send the request to "
                         "an aggregated engine")


def check_blocks_fit(state: RequestState, num_blocks: int, block_size: int,
                     prefix_caching: bool) -> None:
    """A request is handed off once every sequence has its first token, and a parked sequence
    holds its blocks (it is never preempted): one whose sequences cannot all hold the prompt's
    K/V at once would wait forever, so it is refused. Sequences share the prompt's full blocks
    through the prefix cache; each holds its own partial last block."""
    prompt = len(state.prompt_token_ids)
    shared = prompt // block_size if prefix_caching else 0
    need = shared + len(state.seqs) * (-(-prompt // block_size) - shared)
    if need > num_blocks:
        raise ValueError(f"request {state.request_id!r} needs {need} KV blocks to prefill its "
                         f"n={len(state.seqs)} sequences of a {prompt}-token prompt at once, this "
                         f"prefill engine has {num_blocks}: lower n, or give the prefill role "
                         "more KV blocks")


class KVExports:
    def __init__(self, engine: LLMEngine, transport: KVEndpoint, runner: ModelRunner, layout: KVLayout):
        self.engine, self.transport, self.runner, self.layout = engine, transport, runner, layout
        self.marked: set[str] = set()
        self.exporting: dict[str, list[Sequence]] = {}  # request -> parked sequences
        self.handoffs: list[RequestHandoff] = []

    @property
    def busy(self) -> bool:
        return bool(self.exporting)

    def wants(self, seq: Sequence) -> bool:
        return seq.request_id in self.marked

    def park(self, seq: Sequence) -> None:
        sampling = self.runner.seqs.get(seq.seq_id)  # read before the runner forgets it
        if sampling is not None and sampling.generator is not None:
            seq.generator_state = bytes(sampling.generator.get_state().numpy())
        self.engine.scheduler.park(seq)

    def hand_off(self, request_ids: list[str]) -> list[str]:
        """Hand off the ready requests among request_ids; returns those that have outputs."""
        keep = []
        for request_id in request_ids:
            state = self.engine.requests[request_id]
            if request_id not in self.marked or state.finished:
                self.marked.discard(request_id)  # every sequence ended with its first token
                keep.append(request_id)
            elif all(s.status in (SequenceStatus.PARKED, SequenceStatus.FINISHED) for s in state.seqs):
                self.marked.discard(request_id)
                del self.engine.requests[request_id]
                self._export(state)
        return keep

    def _export(self, state: RequestState) -> None:
        parked = [s for s in state.seqs if s.status == SequenceStatus.PARKED]
        index: dict[int, int] = {}  # block id -> position in the transfer; shared blocks once
        tables = {s.seq_id: [index.setdefault(b, len(index)) for b in s.block_table] for s in parked}
        seqs = [SeqHandoff(s.index, list(s.token_ids), s.seed, s.generator_state, s.num_cached_tokens,
                           s.cumulative_logprob, s.logprobs, tables.get(s.seq_id, []))
                for s in state.seqs]
        m = state.metrics
        self.exporting[state.request_id] = parked
        self.transport.offer(state.request_id, list(index))
        self.handoffs.append(RequestHandoff(
            state.request_id, state.prompt, state.prompt_token_ids, state.params, seqs,
            parked[0].num_computed_tokens, len(index), self.layout, self.transport.name,
            m.arrival_time, m.first_scheduled_time, m.first_token_time, parked[0].priority))

    def take(self) -> list[RequestHandoff]:
        out, self.handoffs = self.handoffs, []
        return out

    def on_done(self, done: TransferDone) -> None:
        self._free(done.request_id)

    def abort(self, request_id: str) -> bool:
        """True if request_id was handed off (it has no state left in the engine)."""
        self.marked.discard(request_id)
        if request_id not in self.exporting:
            return False
        self.handoffs = [h for h in self.handoffs if h.request_id != request_id]
        if self.transport.withdraw(request_id):
            self._free(request_id)
        return True  # else being read: freed by its "sent" TransferDone

    def _free(self, request_id: str) -> None:
        for seq in self.exporting.pop(request_id, []):
            self.engine.finish_sequence(seq)
