"""StepResult <-> plain tuples, for the engine process's one message per step.

Pickling dataclasses runs Python code per object (copyreg's __reduce_ex__), with cold caches
right after a step's torch work; tuples, lists, strings and numbers pickle in C (what it
saves: docs/performance.md, "Serving"). The fields are positional in dataclass field order,
so a new field of RequestOutput, CompletionOutput or EngineStats must be added on both sides here
(tests/serve/test_engine_core.py round-trips every field).
"""
from __future__ import annotations

import pickle
from typing import Any

from flagserve.engine.core.loop import StepResult
from flagserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flagserve.engine.stats import EngineStats


def _logprobs(lps: list[dict[int, Logprob]] | None) -> list[dict[int, tuple]] | None:
    if lps is None:
        return None
    return [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()} for d in lps]


def _completion(c: CompletionOutput) -> tuple:
    return (c.index, c.text, c.token_ids, c.cumulative_logprob, _logprobs(c.logprobs),
            c.finish_reason, c.stop_reason)


def _request(o: RequestOutput) -> tuple:
    m = o.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                      m.last_token_time, m.finished_time, m.num_cached_tokens)
    return (o.request_id, o.prompt, o.prompt_token_ids, [_completion(c) for c in o.outputs],
            o.finished, metrics, o.num_cached_tokens, o.error)


def encode(result: StepResult) -> bytes:
    s = result.stats
    stats = (s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries,
             s.prefix_cache_hits, s.prompt_tokens, s.generation_tokens, s.num_preemptions,
             s.num_steps, s.step_seconds, s.forward_seconds,
             s.structured_output_compile_requests, s.structured_output_cache_hits,
             s.kv_sent_bytes, s.kv_received_bytes, s.kv_sent_requests, s.kv_received_requests,
             s.kv_transfer_failures, s.kv_receive_seconds, s.queued_prompt_tokens)
    # Handoffs go as dataclasses: one per request of a prefill engine, not one per step.
    return pickle.dumps(([_request(o) for o in result.outputs], stats, result.time,
                         result.rejected, result.handoffs), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: Any) -> StepResult:
    outputs, stats, time, rejected, handoffs = data
    return StepResult([_decode_request(*o) for o in outputs], EngineStats(*stats), time, rejected,
                      handoffs)


def _decode_request(request_id, prompt, prompt_token_ids, outputs, finished, metrics,
                    num_cached_tokens, error) -> RequestOutput:
    completions = []
    for index, text, token_ids, cumulative, lps, finish, stop in outputs:
        if lps is not None:
            lps = [{t: Logprob(*v) for t, v in d.items()} for d in lps]
        completions.append(CompletionOutput(index, text, token_ids, cumulative, lps, finish, stop))
    return RequestOutput(request_id, prompt, prompt_token_ids, completions, finished,
                         None if metrics is None else RequestMetrics(*metrics), num_cached_tokens,
                         error)
