"""The engine of one replica: a deployment of its own (<id>-engine, deploy.ingress:
separate), or an object inside the ingress replica (deploy.ingress: engine).

Interface to the ingress: `generate`, one call per request; a streaming method over a
DeploymentHandle (stream=True) when it is a deployment, an async generator in process. Each
item it yields carries every token produced since the previous item, so the per-token inner
loop (scheduler, model, sampler) never crosses a Ray Serve hop and a busy ingress receives
fewer, larger chunks instead of falling behind. Non-streaming requests get exactly one item.
Cancelling the call (client disconnect) aborts the request and frees its KV blocks.

The step loop runs where serve.<id>.engine_core says (flagserve/engine/core). With
TP x PP > 1 the replica only schedules: LLMEngine's RayExecutor starts the shard workers
(Ray actors in this replica's own placement group, one per device) and drives them with one
message per step; they die with the replica.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from flagserve.engine.async_engine import AsyncEngine
from flagserve.engine.core.interface import CoreMode, make_core
from flagserve.engine.cpu_runtime import quiet_host_process, serial_tokenizers
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.outputs import RequestOutput, merge_deltas
from flagserve.entrypoints.openai.engine_client import EngineChunk, EngineRequest, ModelInfo
from flagserve.models.config import load_model_config
from flagserve.serve.metrics import EngineMetrics
from flagserve.serve.metrics_hub import push_forever, start_pusher


class EngineDeployment:
    def __init__(self, module_id: str, model_name: str, engine_args: dict[str, Any],
                 metrics_hub: Any = None, engine_core: CoreMode = "thread",
                 meanwhile: Callable[[], None] = lambda: None):
        """`meanwhile`: the replica's own start-up, run while the engine loads (make_core)."""
        self.args = EngineArgs(**engine_args)
        quiet = engine_core == "process" and _in_replica()
        if quiet:
            serial_tokenizers()  # before the spawn: the engine process inherits it

        def own_start() -> None:
            if quiet:
                quiet_host_process()  # the model's threads are the child's (cpu_runtime.py)
            meanwhile()

        core = make_core(self.args, engine_core, own_start)
        self.metrics = EngineMetrics(self.args.kv_transfer.role if self.args.kv_transfer else None)
        self.async_engine = AsyncEngine(core, on_step=self.metrics.on_step)
        defaults = load_model_config(self.args.model).sampling_defaults_for(self.args.generation_config)
        decode = self.args.kv_transfer is not None and self.args.kv_transfer.role == "decode"
        self.info_ = ModelInfo(module_id, model_name, self.args.model, core.max_model_len,
                               core.vocab_size, self.args.scheduling_policy, defaults,
                               self.args.max_num_seqs if decode else None)
        self.metrics_hub = metrics_hub
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit tests)
            self.replica = "0"
        self._pusher: asyncio.Task | None = None

    async def info(self) -> ModelInfo:
        self._start_pusher()
        return self.info_

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self._start_pusher()
        outputs = self.async_engine.generate(request.request_id, request.prompt_token_ids,
                                             request.params, request.arrival_time, request.priority)
        async for chunk in self.chunks(outputs, request.stream):
            yield chunk

    async def chunks(self, outputs: AsyncIterator[RequestOutput], stream: bool
                     ) -> AsyncIterator[EngineChunk]:
        """A request's outputs as chunks: each one (stream), or one when it finishes. (One
        closed early is aborted by AsyncEngine; the engine reports the abort to metrics.)"""
        final: RequestOutput | None = None
        async for out in outputs:
            if out.error is not None:  # a failed KV transfer (disaggregation)
                raise RuntimeError(out.error)
            if stream:
                yield chunk_of(out)
            else:
                final = out if final is None else merge_deltas(final, out)
        if final is not None:
            yield chunk_of(final)

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising restarts the replica."""
        self._start_pusher()  # a replica no request has reached yet shows in /metrics too
        if not self.async_engine.alive:
            raise RuntimeError(f"engine step loop stopped: {self.async_engine.error!r}")

    async def ping(self) -> bool:
        return self.async_engine.alive

    async def stats(self) -> dict:
        return self.metrics.snapshot(self.async_engine.stats)

    def _start_pusher(self) -> None:
        if self.metrics_hub is not None and self._pusher is None:
            self._pusher = start_pusher(asyncio.get_running_loop(), self._push_metrics())

    async def _push_metrics(self) -> None:
        key = (self.info_.model_name, self.replica)
        await push_forever(lambda: self.metrics.snapshot(self.async_engine.stats),
                           lambda snap: self.metrics_hub.push.remote(key, snap))

    def record_routing_stats(self) -> dict[str, Any]:
        """The load routers weigh (serve/routing), asked for by Ray Serve every
        serve.<id>.router.stats_period_s and handed to every caller's router."""
        stats = self.async_engine.stats
        return {"running": stats.num_running, "waiting": stats.num_waiting,
                "kv_usage": stats.kv_cache_usage}

    def shutdown(self) -> None:
        """Stop the step loop (and the engine process or shard workers); idempotent."""
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()


def _in_replica() -> bool:
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside Serve (unit tests): leave this process alone
        return False
    return True


def chunk_of(out: RequestOutput) -> EngineChunk:
    return EngineChunk(out.outputs, len(out.prompt_token_ids), out.num_cached_tokens, out.finished,
                       out.prompt_logprobs)
