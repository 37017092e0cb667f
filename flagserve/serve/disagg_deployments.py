"""The two engine deployments of a disaggregated module (serve.<id>.disaggregation).

    <id>-prefill  runs a request's prompt and samples its first token; `prefill` returns the
                  RequestHandoff (plain data) while the KV waits on the engine's transport
    <id>-decode   `decode` imports a handoff: it receives the KV from the prefill engine
                  (engine to engine, never through Ray Serve) and streams the request on

Each is an EngineDeployment whose engine has EngineArgs.kv_transfer set; the caller that
passes the handoff from one to the other is serve/disagg_client.py. Each prefill replica binds
a KV endpoint of its own (a free port of its host) and names it in its handoffs; a decode
replica connects to each prefill replica it receives from on first use (kv_transfer/p2p.py),
so any number of each pair up, and a restarted replica is a new endpoint.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.util import get_node_ip_address

from flagserve.engine.core.interface import CoreMode
from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.engine.outputs import RequestOutput
from flagserve.entrypoints.openai.engine_client import EngineChunk, EngineRequest
from flagserve.serve.autoscaling import load_report
from flagserve.serve.engine_deployment import EngineDeployment, chunk_of


class RoleDeployment(EngineDeployment):
    def record_autoscaling_stats(self) -> dict[str, float]:
        """The load an autoscaled role scales on (serve/autoscaling.py); Serve asks for it
        with every metrics push once the deployment has an autoscaling_config."""
        return load_report(self.async_engine.stats)


class PrefillDeployment(RoleDeployment):
    def __init__(self, module_id: str, model_name: str, engine_args: dict[str, Any],
                 metrics_hub: Any = None, engine_core: CoreMode = "thread"):
        # Decode replicas on other hosts reach it at the address Ray knows this host by.
        link = {**engine_args["kv_transfer"], "address": f"{node_address()}:0"}
        super().__init__(module_id, model_name, {**engine_args, "kv_transfer": link},
                         metrics_hub, engine_core)

    async def prefill(self, request: EngineRequest) -> AsyncIterator[RequestHandoff | EngineChunk]:
        """Streaming: the request's handoff, or its chunks if every sequence ended with the
        first token. After a handoff the call stays open until the caller cancels it, which it
        does once the decode side has the KV: a caller that goes away before (the client
        disconnected) cancels it earlier, and that withdraws the KV and frees its blocks here.
        The hold ends by itself when the offer has expired anyway."""
        self._start_pusher()
        handed_off = False
        try:
            async for item in self.async_engine.prefill(request.request_id, request.prompt_token_ids,
                                                        request.params, request.arrival_time,
                                                        request.priority):
                if isinstance(item, RequestHandoff):
                    handed_off = True
                    yield item
                else:
                    yield chunk_of(item)
            if handed_off:
                await asyncio.sleep(self.args.kv_transfer.offer_timeout_s)
        finally:
            if handed_off:  # a no-op once the decode side has fetched the KV
                self.async_engine.abort(request.request_id)


class DecodeDeployment(RoleDeployment):
    async def decode(self, handoff: RequestHandoff, stream: bool) -> AsyncIterator[EngineChunk]:
        """Streaming, like generate(): the first chunk carries the first token, once the KV
        has arrived; a failed transfer raises its error. Cancelling aborts the request and
        frees its blocks here (after a receive under way)."""
        self._start_pusher()
        outputs = self._timed(handoff, self.async_engine.import_request(handoff))
        async for chunk in self.chunks(outputs, stream):
            yield chunk

    async def _timed(self, handoff: RequestHandoff, outputs: AsyncIterator[RequestOutput]
                     ) -> AsyncIterator[RequestOutput]:
        """The outputs; the first (the KV has arrived) closes the request's TTFT split."""
        first = True
        async for out in outputs:
            if first and out.error is None:
                self.metrics.on_handoff_received(handoff, time.time())
            first = False
            yield out


def node_address() -> str:
    try:
        return get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests): this host only
        return "127.0.0.1"
