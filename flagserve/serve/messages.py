"""What crosses the ingress <-> engine hop: one request in, a stream of merged deltas out."""
from __future__ import annotations

from dataclasses import dataclass

from flagserve.engine.outputs import SampleLogprobs
from flagserve.engine.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # False: the engine deployment sends one chunk, when the request finishes
    arrival_time: float


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


def merge_choice(a: ChoiceDelta, b: ChoiceDelta) -> ChoiceDelta:
    """`b` following `a` (same choice) as one delta."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return ChoiceDelta(a.index, a.text + b.text, a.token_ids + b.token_ids, logprobs,
                       b.finish_reason, b.stop_reason)


@dataclass
class EngineChunk:
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool


@dataclass
class ModelInfo:
    module_id: str
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
