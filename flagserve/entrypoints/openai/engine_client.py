"""What crosses the ingress <-> engine hop, and the one interface the ingress calls.

One request in (EngineRequest), a stream of merged deltas out (EngineChunk). The engine may
live in the ingress's own process or be a deployment of its own; the serving graph decides
and hands the ingress an EngineClient either way (flagserve/serve/engine_clients.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flagserve.engine.outputs import CompletionOutput, PromptLogprobs
from flagserve.engine.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # False: the engine sends one chunk, when the request finishes
    arrival_time: float
    priority: int = 0  # lower is scheduled earlier (scheduling_policy "priority")


@dataclass
class EngineChunk:
    choices: list[CompletionOutput]  # DELTA outputs: what each choice produced since the last chunk
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None  # params.prompt_logprobs: in one chunk, whole


@dataclass
class ModelInfo:
    module_id: str
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int  # token ids a request may name (the tokenizer's, within the model's)
    scheduling_policy: str = "fcfs"
    # the model's generation_config.json sampling fields: defaults of what a request leaves unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # the most sequences (n) one request may have: a decode role takes them into its batch
    # together, at most its max_num_seqs (None: an aggregated engine queues any n)
    max_n: int | None = None


class EngineClient(Protocol):
    async def info(self) -> ModelInfo: ...

    async def ping(self) -> bool: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Chunks of one request; cancelling or closing the iterator early aborts it."""

    def cancel(self, stream: Any) -> None:
        """Abort the request behind `stream` (a generate() result) whose consumer was cancelled."""

    async def check_health(self) -> None:
        """Raise if the engine behind this client is dead and the replica must restart."""

    def shutdown(self) -> None: ...


class EngineSource(Protocol):
    """How a route reaches its engine; connected once, in the ingress replica."""

    def connect(self, metrics_hub: Any, meanwhile: Callable[[], None]) -> EngineClient:
        """`meanwhile`: the ingress's own start-up, which an engine built in this process runs
        while its model loads (engine/core/interface.py, make_core); others ignore it."""
