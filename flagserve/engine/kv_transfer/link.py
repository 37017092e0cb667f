"""An engine's KV transfer parts: its transport (given, or built from EngineArgs.kv_transfer)
bound to its cache, and the prefill-side and decode-side logic over it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from flagserve.engine.kv_transfer.cache_io import KVCaches
from flagserve.engine.kv_transfer.exports import KVExports
from flagserve.engine.kv_transfer.imports import KVImports
from flagserve.engine.kv_transfer.transport import KVEndpoint

if TYPE_CHECKING:
    from flagserve.engine.llm_engine import LLMEngine


def link_engine(engine: LLMEngine, transport: KVEndpoint | None
                ) -> tuple[KVEndpoint | None, KVExports | None, KVImports | None]:
    config = engine.args.kv_transfer
    if transport is None and config is None:
        return None, None, None
    runner = getattr(engine.executor, "runner", None)
    if runner is None:  # the cache lives in the Ray shard workers
        raise ValueError("prefill/decode disaggregation (EngineArgs.kv_transfer) needs "
                         "tensor_parallel_size = pipeline_parallel_size = 1 for now")
    caches = KVCaches.of_runner(runner)
    if transport is None:
        from flagserve.engine.kv_transfer.p2p import P2PTransport  # torch.distributed only here
        transport = P2PTransport(config, caches.device.type == "cuda")
    transport.bind(caches)
    return (transport, KVExports(engine, transport, runner, caches.layout),
            KVImports(engine, transport, caches.layout))
