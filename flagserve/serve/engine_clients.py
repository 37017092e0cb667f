"""The two EngineClients of the ingress (entrypoints/openai/engine_client.py), and the sources
the serving graph binds into the ingress to build one in its replica.

    LocalEngine   the engine lives in the ingress replica (deploy.ingress: engine, the default
                  for one LLM module): a request's tokens reach the HTTP response through an
                  asyncio queue, with no Ray hop and no serialization on the way.
    RemoteEngine  the engine is a deployment of its own (<id>-engine): one streaming Serve
                  call per request.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from flagserve.engine.core.interface import CoreMode
from flagserve.entrypoints.openai.engine_client import EngineChunk, EngineClient, EngineRequest, ModelInfo


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

    async def check_health(self) -> None:
        """The engine deployment has a health check of its own."""

    def shutdown(self) -> None:
        """The engine deployment is stopped by Serve."""


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


@dataclass
class LocalEngineSpec:
    """An engine to build in the ingress replica (the arguments of EngineDeployment)."""
    module_id: str
    model_name: str
    engine_args: dict[str, Any]
    engine_core: CoreMode

    def connect(self, metrics_hub: Any, meanwhile: Callable[[], None]) -> EngineClient:
        from flagserve.serve.engine_deployment import EngineDeployment  # heavy: torch
        return LocalEngine(EngineDeployment(self.module_id, self.model_name, self.engine_args,
                                            metrics_hub, self.engine_core, meanwhile))


@dataclass
class RemoteEngineSpec:
    handle: Any  # the engine deployment, bound; Serve hands the replica a DeploymentHandle

    def connect(self, metrics_hub: Any, meanwhile: Callable[[], None]) -> EngineClient:
        return RemoteEngine(self.handle)
