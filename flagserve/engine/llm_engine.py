"""LLMEngine: requests in, RequestOutputs out, one scheduler + model step at a time.

The offline `LLM` loops over step(); the server drives the same loop from an async task.
"""
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flagserve.engine.bad_words import bad_words_token_ids
from flagserve.engine.block_manager import BlockManager
from flagserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.executor import make_executor
from flagserve.engine.kv_budget import batched_tokens
from flagserve.engine.kv_transfer.exports import check_blocks_fit, check_handoff_params
from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.engine.kv_transfer.link import link_engine
from flagserve.engine.kv_transfer.transport import KVEndpoint, TransferStats
from flagserve.engine.model_runner import resolve_device
from flagserve.engine.outputs import (
    CompletionOutput,
    FinishReason,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    logprob_entry,
)
from flagserve.engine.prompt_logprobs import record_prompt_scores
from flagserve.engine.prompts import prompt_fields
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams
from flagserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, check_priority
from flagserve.engine.sequence import Sequence, SequenceStatus
from flagserve.engine.stats import EngineStats
from flagserve.engine.step_input import StepInputBuilder
from flagserve.engine.structured_outputs.matchers import Advance, StructuredOutputs
from flagserve.layers.sampler import DeviceSamples, PromptScores, SamplerOutput
from flagserve.models.config import load_model_config
from flagserve.models.tokenizer import load_tokenizer, prompt_vocab_size, special_edges

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # an idle engine waits this long for a grammar before the loop looks again
KV_WAIT_S = 0.05  # likewise for a KV transfer, when transfers are all it has
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n samples of one seeded request: the int64 seed
    as its 64 bits (one to one), times an odd number plus the index's share, mod 2**64, so
    distinct seeds give distinct child seeds at each index (a generator takes [0, 2**64))."""
    return seed if index == 0 else ((seed % 2**64) * 0x9E3779B1 + index * 0x85EBCA77) % 2**64


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    sent_text: list[int]  # per sequence, for DELTA outputs: chars and tokens already returned
    sent_tokens: list[int]
    error: str | None = None  # the engine ended it (a failed KV transfer)
    hold: int = 0  # characters held back: they may turn out to be the start of a stop string
    sent_prompt_logprobs: bool = False  # DELTA outputs: the one that carried them went out
    # DELTA outputs: sequences whose finish went out; later outputs leave them out (a stream of
    # n choices would otherwise repeat each finished one's end until the last finishes)
    sent_finish: set[int] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs, kv_transport: KVEndpoint | None = None):
        self.args = args
        self.model_config = cfg = load_model_config(args.model)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.prompt_vocab_size = prompt_vocab_size(cfg.vocab_size, self.tokenizer)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"EngineArgs.max_model_len={self.max_model_len} exceeds the model's "
                             f"{cfg.positions_text}; lower it")
        device_type = resolve_device(args.device).type
        batched = batched_tokens(args, self.max_model_len, device_type == "cuda")
        if not args.enable_chunked_prefill and batched < self.max_model_len:
            raise ValueError(f"EngineArgs.max_num_batched_tokens={batched} is smaller than max_model_len="
                             f"{self.max_model_len}: without chunked prefill a whole prompt must fit "
                             "in one step; raise it or enable_chunked_prefill=True")
        # what requests that leave a sampling field unset get: the model's, or SamplingParams'
        self.sampling_defaults = cfg.sampling_defaults_for(args.generation_config)
        eos = cfg.eos_token_ids or ((self.tokenizer.eos_token_id,)
                                    if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids = frozenset(eos)
        # vLLM's: the tokenizer's EOS ends an output with stop_reason None; the model's other
        # end-of-sequence ids (generation_config.json's) act as stop tokens, naming themselves
        primary = self.tokenizer.eos_token_id
        self.primary_eos = primary if primary in eos else (eos[0] if eos else None)
        # In this process with TP = PP = 1, else TP x PP shard workers under Ray.
        self.executor = make_executor(args, cfg, self.max_model_len, tuple(eos))
        self.async_scheduling = args.overlaps_steps(device_type, kv_transport)
        self.step_inputs = StepInputBuilder(self.async_scheduling)
        # Async scheduling: the step on the device (its sampled sequences and samples)
        self._in_flight: tuple[list[Sequence], DeviceSamples] | None = None
        self.block_manager = BlockManager(self.executor.num_kv_blocks, args.block_size,
                                          args.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, batched, args.enable_chunked_prefill,
                            self.max_model_len, args.scheduling_policy),
            self.block_manager)
        self.requests: dict[str, RequestState] = {}
        self.structured = StructuredOutputs(args.tokenizer or args.model, cfg.vocab_size, list(eos),
                                           args.max_num_seqs)
        self._prompt_tokens = 0
        self._token_texts: dict[int, str] = {}  # logprob entries' decoded_token, by token id
        self._generation_tokens = 0
        self._num_steps = 0
        self._step_seconds = 0.0
        # Disaggregation (kv_transfer/): None unless a transport is given or configured.
        self.kv_transport, self.kv_exports, self.kv_imports = link_engine(self, kv_transport)

    # Requests

    def _tokenize(self, prompt: str | list[int] | dict
                  ) -> tuple[str | None, list[int], tuple[int, int]]:
        """A text, token ids, or vLLM's TextPrompt / TokensPrompt dict (a TokensPrompt's
        `prompt` text is kept for the outputs): (text, ids, the special tokens the tokenizer
        put around an encoded text's ids, none around given ids: what a truncation keeps)."""
        if isinstance(prompt, dict):
            text, ids = prompt_fields(prompt)
            if ids is not None:
                return text, self._ids(ids), (0, 0)
            prompt = text
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), special_edges(self.tokenizer)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string, token ids or a dict, got {type(prompt).__name__}")
        return None, self._ids(prompt), (0, 0)

    def _ids(self, prompt: list[int]) -> list[int]:
        ids = list(prompt)
        vocab = self.prompt_vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), the tokenizer's "
                             f"vocabulary; got {bad[:5]}")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """`prompt`: a text, token ids, or vLLM's prompt dict; `priority` (vLLM's): lower is
        scheduled earlier, with scheduling_policy "priority"."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.args.scheduling_policy)
        # Checked again here, not only where params are built: a value the step cannot take
        # (a seed torch cannot hold, a token id past the logits) would fail the whole batch's
        # step and kill the engine; here it fails this request only.
        params.validate()
        vocab = self.model_config.vocab_size
        params.check_vocab(vocab)
        params.bad_words_token_ids = (bad_words_token_ids(self.tokenizer, params.bad_words, vocab)
                                      if params.bad_words else None)
        text, ids, edges = self._tokenize(prompt)
        ids = params.truncated(ids, self.max_model_len, edges)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                             f"at most {self.max_model_len - 1} prompt tokens leave room to generate")
        arrival = time.time() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, i, list(ids), len(ids), params, arrival,
                         None if params.seed is None else child_seed(params.seed, i), priority)
                for i in range(params.n)]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]
        self.new_request_state(request_id, text, ids, params, seqs, RequestMetrics(arrival))
        if params.structured_outputs is not None:
            self.structured.hold(request_id, seqs)  # scheduled once its grammar is compiled
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def new_request_state(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                   seqs: list[Sequence], metrics: RequestMetrics) -> RequestState:
        # Text read only at the end and no stop strings to find in it: decoded once, then (or
        # never, without detokenize).
        deferred = (params.output_kind == FINAL_ONLY or not params.detokenize) and not params.stop_list
        detoks = [IncrementalDetokenizer.for_prompt(self.tokenizer, len(ids), params.skip_special_tokens,
                                                    deferred) for _ in seqs]
        state = RequestState(request_id, text, ids, params, seqs, detoks, metrics,
                             [0] * len(seqs), [0] * len(seqs),
                             hold=max(map(len, params.stop_list)) - 1 if params.stop_list else 0)
        self.requests[request_id] = state
        return state

    # Prefill/decode disaggregation (kv_transfer/)

    def add_prefill_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                            arrival_time: float | None = None, priority: int = 0) -> None:
        """add_request, then a handoff after the first token: take_handoffs() gives it, the
        transport serves its KV to a decode engine, and it has no outputs here (unless every
        sequence ended with its first token: then its final output comes as usual)."""
        if self.kv_exports is None:
            raise ValueError("add_prefill_request needs a KV transport (EngineArgs.kv_transfer)")
        check_handoff_params(params)
        self.add_request(request_id, prompt, params, arrival_time, priority)
        bm = self.block_manager
        try:
            check_blocks_fit(self.requests[request_id], bm.num_blocks, bm.block_size,
                             self.args.enable_prefix_caching)
        except ValueError:
            self.abort(request_id)
            raise
        self.kv_exports.marked.add(request_id)

    def take_handoffs(self) -> list[RequestHandoff]:
        """The requests handed off since the last call, for a decode engine's import_request."""
        return self.kv_exports.take() if self.kv_exports is not None else []

    def import_request(self, handoff: RequestHandoff) -> None:
        """Continue a prefill engine's request: it waits for blocks, receives its KV over the
        transport, then decodes; its first output carries the first token."""
        if self.kv_imports is None:
            raise ValueError("import_request needs a KV transport (EngineArgs.kv_transfer)")
        self.kv_imports.add(handoff)

    def _poll_transfers(self) -> list[str]:
        """Apply finished transfers, start the imports that fit; the requests with outputs."""
        touched = []
        for done in self.kv_transport.poll():
            if done.side == "sent":
                self.kv_exports.on_done(done)
            elif (request_id := self.kv_imports.on_done(done)) is not None:
                touched.append(request_id)
        self.kv_imports.admit()
        return touched

    def abort(self, request_id: str) -> bool:
        """Withdraw a request; True when it was one of this engine's unfinished requests (an
        unknown or finished id is a no-op, as is KV already handed off to a decode engine)."""
        if self.kv_exports is not None and self.kv_exports.abort(request_id):
            return False  # handed off: its blocks are freed now or once the transport has read them
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        if self.kv_imports is not None and self.kv_imports.drop(request_id):
            return True  # still waiting or fetching: the import frees what it holds
        if self.structured.drop(request_id):  # never scheduled
            for seq in state.seqs:
                seq.finish_reason, seq.status = FinishReason.ABORT, SequenceStatus.FINISHED
            return True
        for seq in state.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.finish_sequence(seq)
        return True

    def finish_sequence(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.structured.forget(seq)
        self.step_inputs.release(seq)  # the sampling shard drops its state with the next step

    def has_unfinished(self) -> bool:
        return bool(self.requests) or (self.kv_exports is not None and self.kv_exports.busy)

    # vLLM's names for the same
    has_unfinished_requests = has_unfinished

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(request_id)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the cached prefixes; False (nothing done) while a request holds KV."""
        return self.block_manager.reset_prefix_cache()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # The step

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        failed = self._admit_compiled()
        if self.kv_transport is not None:
            failed += self._poll_transfers()  # imported (first token) or failed requests
        batch = self.scheduler.schedule()
        if not batch.seqs:
            touched = self._land()
            if self.structured.num_held and not failed and not touched:
                self.structured.wait(GRAMMAR_WAIT_S)  # nothing else to run: no busy loop
            elif self.kv_transport is not None and not failed:
                self.kv_transport.wait(KV_WAIT_S)
            return self._outputs(list(dict.fromkeys(failed + touched)))
        now = time.time()
        for seq in batch.admitted:  # the others were scheduled before
            state = self.requests[seq.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                self._prompt_tokens += len(state.prompt_token_ids)
        touched = self._run(batch)
        outputs = self._outputs(list(dict.fromkeys(failed + touched)))
        self._num_steps += 1
        self._step_seconds += time.perf_counter() - start
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[str]:
        """Run the batch; the requests with new tokens. With async scheduling the step is
        queued on the device and the step before it lands (its tokens appended and checked)
        while it runs, unless the step samples with a grammar or penalties (those need every
        token on the host) or scores a prompt: it runs through (the step before landing first)."""
        step = self.step_inputs.build(batch)
        sampled = [batch.seqs[i] for i in step.sample_indices]
        step.token_bitmask = self.structured.bitmask(sampled)
        overlap = (self.async_scheduling and step.token_bitmask is None and step.output_token_ids is None
                   and not step.prompt_rows)
        samples = self.executor.launch(step) if overlap else self.executor.execute(step)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        touched = self._land()
        if samples is None:
            return touched
        if not overlap and samples.prompt_scores:
            self._record_prompt_scores(batch.seqs, samples.prompt_scores)
            if not sampled:  # a chunk that scored its prompt and ends none
                return touched
        if overlap:
            for seq in sampled:
                seq.num_pending += 1
            self._in_flight = (sampled, samples)
            return touched
        return touched + self._process_samples(*self._live(sampled, samples))

    def _land(self) -> list[str]:
        """The step in flight's samples (async scheduling): on the host, appended, checked."""
        if self._in_flight is None:
            return []
        seqs, samples = self._in_flight
        self._in_flight = None
        out = samples.host()
        for seq in seqs:
            seq.num_pending -= 1
        return self._process_samples(*self._live(seqs, out))

    def _live(self, seqs: list[Sequence], out: SamplerOutput) -> tuple[list[Sequence], SamplerOutput]:
        """Without the rows of sequences that ended while their step ran (async scheduling:
        they ran one step past their end, or were aborted): those samples are void."""
        if not self.async_scheduling:
            return seqs, out
        rows = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        if len(rows) == len(seqs):
            return seqs, out
        return [seqs[i] for i in rows], out.select(rows)

    def _outputs(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = [o for o in (self._make_output(self.requests[r]) for r in request_ids) if o is not None]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _admit_compiled(self) -> list[str]:
        """Schedule the requests whose grammar is ready; end (abort) those whose compilation
        failed, returning their ids. validate() parsed the grammar already, so a failure here
        is the compiler's own (out of memory, a vocabulary it cannot take)."""
        ready, failed = self.structured.release()
        for seq in ready:
            self.scheduler.add(seq)
        for request_id, err in failed:
            logger.error("grammar compilation failed for request %s: %s", request_id, err)
            for seq in self.requests[request_id].seqs:
                seq.finish_reason, seq.status = FinishReason.ABORT, SequenceStatus.FINISHED
        return [request_id for request_id, _ in failed]

    def _process_samples(self, seqs: list[Sequence], out: SamplerOutput) -> list[str]:
        now = time.time()
        touched: dict[str, None] = {}
        for seq, token in zip(seqs, out.token_ids):
            seq.token_ids.append(token)
        grammars = self.structured.advance_all(seqs)
        self._generation_tokens += len(seqs)
        handoffs = self.kv_exports is not None  # they look at every request they may park
        for row, (seq, token, grammar) in enumerate(zip(seqs, out.token_ids, grammars)):
            if seq.params.logprobs is not None:
                self._record_logprobs(seq, row, out)
            state = self.requests[seq.request_id]
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            self.check_stop(seq, state.detokenizers[seq.index], token)
            if grammar is not None:
                self._grammar_verdict(seq, token, grammar)
            if seq.finish_reason is not None:
                self.finish_sequence(seq)
            elif handoffs and self.kv_exports.wants(seq):
                self.kv_exports.park(seq)  # its first token: the decode engine goes on
            # A request that wants only its final output has none until it finishes: building
            # and dropping one per token was most of offline generate's output cost.
            if handoffs or seq.finish_reason is not None or state.params.output_kind != FINAL_ONLY:
                touched[seq.request_id] = None
        return self.kv_exports.hand_off(list(touched)) if handoffs else list(touched)

    @staticmethod
    def _grammar_verdict(seq: Sequence, token: int, grammar: Advance) -> None:
        if grammar == "rejected":  # the mask allowed only grammar tokens: a bug, not the model
            logger.error("request %s: token %d is outside its grammar", seq.request_id, token)
            seq.finish_reason = FinishReason.ABORT
        elif grammar == "terminated" and seq.finish_reason is None:
            seq.finish_reason = FinishReason.STOP  # complete (ignore_eos, or a stop token id)

    def _decoder(self, params: SamplingParams) -> Callable[[int], str | None]:
        """A logprob entry's decoded_token."""
        return self._token_text if params.detokenize else (lambda _: None)

    def _token_text(self, token_id: int) -> str:
        # One decode per vocabulary entry: a scored prompt asks for (1 + top-N) per token, at
        # ~6 us a decode on CPU.
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _record_logprobs(self, seq: Sequence, row: int, out: SamplerOutput) -> None:
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + out.logprobs[row]
        tops = None if out.top_token_ids is None else (out.top_token_ids[row][:seq.params.logprobs],
                                                       out.top_logprobs[row])
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(logprob_entry(out.token_ids[row], out.logprobs[row], out.ranks[row], tops,
                                          self._decoder(seq.params)))

    def _record_prompt_scores(self, seqs: list[Sequence], scores: list[PromptScores]) -> None:
        by_id = {seq.seq_id: seq for seq in seqs}
        for s in scores:
            seq = by_id[s.seq_id]
            record_prompt_scores(seq, s, self._decoder(seq.params))

    def check_stop(self, seq: Sequence, detok: IncrementalDetokenizer, token: int) -> None:
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        may_stop = num_output >= p.min_tokens  # the sampler bans stop tokens before it
        eos = not p.ignore_eos and token in self.eos_token_ids
        if may_stop and (eos or token in p.stop_token_ids):
            if p.include_stop_str_in_output:  # vLLM's: the stop token's text is kept
                detok.append(seq.token_ids)
            reason = None if eos and token == self.primary_eos else token
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, reason
        else:
            delta = detok.append(seq.token_ids)
            # vLLM's rule: a stop string ends the output only past min_tokens tokens
            if num_output > p.min_tokens and p.stop_list and delta:
                hit = find_stop_string(detok.text, len(delta), p.stop_list)
                if hit is not None:
                    stop, idx = hit
                    detok.text = detok.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                    return
            if seq.reaches_length(self.max_model_len):
                seq.finish_reason = FinishReason.LENGTH

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        kind = state.params.output_kind
        if kind == FINAL_ONLY and not finished:
            return None
        metrics = state.metrics
        if finished:
            metrics.finished_time = time.time()
        completions = [self._completion(state, seq, detok, kind)
                       for seq, detok in zip(state.seqs, state.detokenizers)
                       if seq.index not in state.sent_finish]
        metrics.num_cached_tokens = max(s.num_cached_tokens for s in state.seqs)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, metrics, metrics.num_cached_tokens, state.error,
                             self._prompt_logprobs(state, kind))

    @staticmethod
    def _prompt_logprobs(state: RequestState, kind: RequestOutputKind) -> PromptLogprobs | None:
        """Once every prompt token is scored; DELTA outputs carry it once."""
        scored = state.seqs[0].prompt_logprobs
        if scored is None or len(scored) < len(state.prompt_token_ids) or state.sent_prompt_logprobs:
            return None
        state.sent_prompt_logprobs = kind == RequestOutputKind.DELTA
        return list(scored)

    @staticmethod
    def _completion(state: RequestState, seq: Sequence, detok: IncrementalDetokenizer,
                    kind: RequestOutputKind) -> CompletionOutput:
        if detok.deferred and state.params.detokenize:
            detok.flush(seq.token_ids)
        text, logprobs, i = detok.text, seq.logprobs, seq.index
        if state.hold and not seq.is_finished:
            text = text[:max(len(text) - state.hold, state.sent_text[i])]
        if kind == RequestOutputKind.DELTA:
            sent = state.sent_tokens[i]
            text, tokens = text[state.sent_text[i]:], seq.token_ids[seq.num_prompt_tokens + sent:]
            logprobs = logprobs[sent:] if logprobs is not None else None
            state.sent_text[i] += len(text)
            state.sent_tokens[i] += len(tokens)
            if seq.is_finished:
                state.sent_finish.add(i)
        else:
            tokens = seq.output_token_ids
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(i, text, tokens, seq.cumulative_logprob, logprobs, seq.finish_reason,
                                seq.stop_reason)

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        t = self.kv_transport.stats if self.kv_transport is not None else TransferStats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.structured.held_seqs
            + (self.kv_imports.waiting_seqs if self.kv_imports is not None else 0),
            kv_cache_usage=bm.usage(),
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            step_seconds=self._step_seconds,
            forward_seconds=self.executor.forward_seconds,
            structured_output_compile_requests=self.structured.compile_requests,
            structured_output_cache_hits=self.structured.cache_hits,
            kv_sent_bytes=t.bytes_sent, kv_received_bytes=t.bytes_received,
            kv_sent_requests=t.requests_sent, kv_received_requests=t.requests_received,
            kv_transfer_failures=t.failures, kv_receive_seconds=t.receive_seconds,
            queued_prompt_tokens=self.scheduler.queued_prompt_tokens(),
        )

    def shutdown(self) -> None:
        """Stop the shard workers (TP x PP > 1); the engine is unusable afterwards."""
        self.executor.shutdown()
        self.structured.shutdown()
        if self.kv_transport is not None:
            self.kv_transport.close()
