"""How the ingress talks to an engine: in its own process, or over a Ray Serve handle.

    LocalEngine   the engine lives in the ingress replica (deploy.ingress: engine, the default
                  for one LLM module): a request's tokens reach the HTTP response through an
                  asyncio queue, with no Ray hop and no serialization on the way.
    RemoteEngine  the engine is a deployment of its own (<id>-engine): one streaming Serve
                  call per request.

Both give the ingress the same three calls; `generate` returns an async iterator of
EngineChunk that aborts the request in the engine when it is cancelled or closed early.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from flagserve.serve.messages import EngineChunk, EngineRequest, ModelInfo


@dataclass
class LocalEngineSpec:
    """What an ingress needs to build its own engine (the arguments of EngineDeployment)."""
    module_id: str
    model_name: str
    engine_args: dict[str, Any]
    engine_core: str  # process | thread: where the step loop runs


class EngineClient(Protocol):
    async def info(self) -> ModelInfo: ...

    async def ping(self) -> bool: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]: ...

    def cancel(self, stream: AsyncIterator[EngineChunk]) -> None: ...


class RemoteEngine:
    def __init__(self, handle: Any):
        self.handle = handle
        self.streaming = handle.options(stream=True)

    async def info(self) -> ModelInfo:
        return await self.handle.info.remote()

    async def ping(self) -> bool:
        return await self.handle.ping.remote()

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        return self.streaming.generate.remote(request)

    def cancel(self, stream: Any) -> None:
        stream.cancel()  # Serve cancels the replica's generator: the engine aborts the request


class LocalEngine:
    def __init__(self, server: Any):
        self.server = server  # an EngineDeployment object, constructed in this process

    async def info(self) -> ModelInfo:
        return await self.server.info()

    async def ping(self) -> bool:
        return await self.server.ping()

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        return self.server.generate(request)

    def cancel(self, stream: Any) -> None:
        """Nothing to do: the task iterating `stream` is cancelled (streams.batches), which
        runs the generator's cleanup, and that aborts the request."""

    async def check_health(self) -> None:
        await self.server.check_health()

    def shutdown(self) -> None:
        self.server.shutdown()


def engine_client(engine: Any, metrics_hub: Any) -> EngineClient:
    """The client for a route's engine: a LocalEngineSpec is built here, in this process."""
    if isinstance(engine, LocalEngineSpec):
        from flagserve.serve.engine_deployment import EngineDeployment  # heavy: torch
        return LocalEngine(EngineDeployment(engine.module_id, engine.model_name,
                                            engine.engine_args, metrics_hub, engine.engine_core))
    return RemoteEngine(engine)
