"""The ingress's EngineClient of a disaggregated module: one request, two Serve calls.

    ingress --EngineRequest--> <id>-prefill --RequestHandoff--> ingress --> <id>-decode
                                     \\______ KV, engine to engine (gloo / NCCL) ______/

The handoff is plain data (tokens, sampling state, block layout); the KV never crosses Ray
Serve. The client sees one ordinary stream: the decode side's chunks, the first carrying the
first token. The prefill call is held open until the decode side's first chunk (its KV has
arrived, or failed), so that a request given up before that (client disconnect) cancels
both calls and each engine frees its blocks.

Each call goes to the replica its deployment's router picks (serve/routing): prefill by
serve.<id>.router (prefix_aware by default: the replica whose prefix cache likely holds the
prompt), decode by load. A request that fails before the client has seen a token (a transfer
that failed, a replica that died) is tried once more from the start, under a new id: the
routers then see the failed replica's load, or Serve has dropped it. One that fails after
tokens went out cannot be replayed (seeded streams would differ) and ends with its error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.entrypoints.openai.engine_client import EngineChunk, EngineClient, EngineRequest, ModelInfo
from flagserve.entrypoints.openai.errors import error_message

log = logging.getLogger(__name__)
ATTEMPTS = 2


class HandoffError(RuntimeError):
    """A disaggregated request that could not be completed: why, and whether it was retried."""


class DisaggregatedEngine:
    def __init__(self, prefill: Any, decode: Any):
        self.prefill, self.decode = prefill, decode
        self.prefill_stream = prefill.options(stream=True)
        self.decode_stream = decode.options(stream=True)

    async def info(self) -> ModelInfo:
        """The decode role's, with the context both roles take (a prompt goes through both)."""
        decode, prefill = await asyncio.gather(self.decode.info.remote(), self.prefill.info.remote())
        # the prefill side queues and schedules arrivals: its policy is the one priority meets
        return dataclasses.replace(decode, max_model_len=min(decode.max_model_len,
                                                             prefill.max_model_len),
                                   scheduling_policy=prefill.scheduling_policy)

    async def ping(self) -> bool:
        return all(await asyncio.gather(self.prefill.ping.remote(), self.decode.ping.remote()))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        streamed = False
        for attempt in range(1, ATTEMPTS + 1):
            # A retry runs under its own id: the first attempt's abort may still be on its way
            # to the engines that held it.
            tried = request if attempt == 1 else dataclasses.replace(
                request, request_id=f"{request.request_id}-retry{attempt - 1}")
            try:
                async for chunk in self._attempt(tried):
                    streamed = True
                    yield chunk
                return
            except ValueError:
                raise  # the request itself was refused: the same again
            except Exception as err:  # noqa: BLE001 - retried, or raised with why
                why = error_message(err)
                if streamed:
                    raise HandoffError(f"request {request.request_id}: the decode replica failed "
                                        f"after streaming began ({why}); not retried, as its "
                                        "tokens were already sent") from err
                if attempt == ATTEMPTS:
                    raise HandoffError(f"request {request.request_id} failed {ATTEMPTS} times "
                                        f"between prefill and decode; last: {why}") from err
                log.warning("request %s failed between prefill and decode (%s); retrying",
                            request.request_id, why)

    async def _attempt(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        prefill = self.prefill_stream.prefill.remote(request)
        decode = None
        try:
            async for item in prefill:
                if not isinstance(item, RequestHandoff):
                    yield item  # every sequence ended with its first token: no decode side
                    continue
                decode = self.decode_stream.decode.remote(item, request.stream)
                held = True
                async for chunk in decode:
                    if held:  # the decode side has the KV: the prefill side lets go
                        prefill.cancel()
                        held = False
                    yield chunk
                return
        finally:  # also on cancellation (client disconnect) and failure: both engines abort
            prefill.cancel()
            if decode is not None:
                decode.cancel()

    def cancel(self, stream: Any) -> None:
        """Nothing to do: cancelling the task iterating `stream` runs generate's cleanup,
        which cancels both Serve calls."""

    async def check_health(self) -> None:
        """Both deployments have health checks of their own."""

    def shutdown(self) -> None:
        """Serve stops both deployments."""


@dataclass
class DisaggregatedEngineSpec:
    prefill: Any  # <id>-prefill, bound; Serve hands the replica a DeploymentHandle
    decode: Any

    def connect(self, metrics_hub: Any, meanwhile: Callable[[], None]) -> EngineClient:
        return DisaggregatedEngine(self.prefill, self.decode)
