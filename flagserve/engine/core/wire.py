"""StepResult <-> plain tuples, for the engine process's one message per step.

Pickling dataclasses runs Python code per object (copyreg's __reduce_ex__), with cold caches
right after a step's torch work; tuples, lists, strings and numbers pickle in C (what it
saves: docs/performance.md, "Serving"). The fields are positional in dataclass field order,
so a new field of RequestOutput, CompletionOutput or EngineStats must be added on both sides here
(tests/api/test_engine_core.py round-trips every field).

A request's prompt (text and token ids) goes with its first output only; the Decoder keeps
it for the request's later outputs (with 256 streams of ~500-token prompts, sending it every
step was ~10^5 ints pickled and unpickled per step for nothing). Both sides forget a request
with its final output, or when it is aborted.
"""
from __future__ import annotations

import pickle
from typing import Any

from flagserve.engine.core.loop import StepResult
from flagserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from flagserve.engine.stats import EngineStats


def _logprobs(lps: PromptLogprobs | None) -> list[dict[int, tuple] | None] | None:
    if lps is None:
        return None
    return [None if d is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()}
            for d in lps]


def _from_logprobs(lps: list[dict[int, tuple] | None] | None) -> PromptLogprobs | None:
    if lps is None:
        return None
    return [None if d is None else {t: Logprob(*v) for t, v in d.items()} for d in lps]


def _completion(c: CompletionOutput) -> tuple:
    return (c.index, c.text, c.token_ids, c.cumulative_logprob, _logprobs(c.logprobs),
            c.finish_reason, c.stop_reason)


def _request(o: RequestOutput, with_prompt: bool) -> tuple:
    m = o.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                      m.last_token_time, m.finished_time, m.num_cached_tokens)
    prompt = (o.prompt, o.prompt_token_ids) if with_prompt else None
    return (o.request_id, prompt, [_completion(c) for c in o.outputs], o.finished, metrics,
            o.num_cached_tokens, o.error, _logprobs(o.prompt_logprobs))


def _stats(s: EngineStats) -> tuple:
    return (s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries,
            s.prefix_cache_hits, s.prompt_tokens, s.generation_tokens, s.num_preemptions,
            s.num_steps, s.step_seconds, s.forward_seconds,
            s.structured_output_compile_requests, s.structured_output_cache_hits,
            s.kv_sent_bytes, s.kv_received_bytes, s.kv_sent_requests, s.kv_received_requests,
            s.kv_transfer_failures, s.kv_receive_seconds, s.queued_prompt_tokens)


class Encoder:
    """The engine process's side: StepResult -> bytes."""

    def __init__(self) -> None:
        self._sent: set[str] = set()  # requests whose prompt went out already

    def forget(self, request_id: str) -> None:
        self._sent.discard(request_id)

    def encode(self, result: StepResult) -> bytes:
        requests = []
        for o in result.outputs:
            requests.append(_request(o, o.request_id not in self._sent))
            if o.finished:
                self._sent.discard(o.request_id)
            else:
                self._sent.add(o.request_id)
        # Handoffs go as dataclasses: one per request of a prefill engine, not one per step.
        return pickle.dumps((requests, _stats(result.stats), result.time, result.rejected,
                             result.handoffs, result.aborted), protocol=pickle.HIGHEST_PROTOCOL)


class Decoder:
    """The replica's side: the unpickled tuples -> StepResult."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def decode(self, data: Any) -> StepResult:
        outputs, stats, time, rejected, handoffs, aborted = data
        return StepResult([self._request(*o) for o in outputs], EngineStats(*stats), time, rejected,
                          handoffs, aborted)

    def _request(self, request_id, prompt, outputs, finished, metrics, num_cached_tokens,
                 error, prompt_logprobs) -> RequestOutput:
        if prompt is not None and not finished:
            self._prompts[request_id] = prompt
        elif prompt is None:
            # Kept from its first output; (None, []) once aborted here: a late output of a
            # request nobody reads any more.
            prompt = (self._prompts.pop if finished else self._prompts.get)(request_id, (None, []))
        completions = []
        for index, text, token_ids, cumulative, lps, finish, stop in outputs:
            completions.append(CompletionOutput(index, text, token_ids, cumulative, _from_logprobs(lps),
                                                finish, stop))
        return RequestOutput(request_id, *prompt, completions, finished,
                             None if metrics is None else RequestMetrics(*metrics), num_cached_tokens,
                             error, _from_logprobs(prompt_logprobs))
