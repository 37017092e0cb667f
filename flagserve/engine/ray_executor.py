"""TP x PP shard workers under Ray, driven with one message per step.

One placement group per model replica, one bundle per device (bundle i = global rank i, so a
stage's TP ranks are consecutive and PACK keeps them on one host; `placement_hosts` pins each
stage to a node). Every step the same StepInput goes to every worker; stages pass activations
to each other with torch.distributed, and only the sampling shard's reply carries tokens.
The step goes out through a Ray compiled graph (shared-memory channels, faster than actor
calls: docs/performance.md) when it compiles, else as plain actor calls. Waiting on all
replies (not just the sampler's) makes a failing shard fail the step instead of leaving its
peers blocked in a collective.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flagserve.distributed.placement import shard_bundles
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.executor import decide_kv_blocks
from flagserve.engine.step_input import StepInput
from flagserve.engine.worker import ShardWorker
from flagserve.layers.sampler import SamplerOutput
from flagserve.models.config import ModelConfig

PLACEMENT_TIMEOUT_S = 120.0
# A compiled graph's readers wait for the next step by spinning (sched_yield), a core per
# shard, taking an idle CPU deployment's cores from every other process. CPU shards tear the
# graph down after this long without a step and the next step compiles it again (what each
# costs: docs/performance.md, Idle shards). GPU shards keep it: their hosts' cores are not
# the model's.
IDLE_TEARDOWN_S = 5.0
log = logging.getLogger(__name__)


def _wants_gpu(device: str) -> bool:
    if device == "auto":  # the engine process itself may see no GPU: ask the cluster
        return ray.cluster_resources().get("GPU", 0) > 0
    return device.startswith("cuda")


class RayExecutor:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        self.workers: list = []
        self.pg = None
        self.graph = None
        self._use_graph = os.environ.get("FLAGSERVE_COMPILED_GRAPH", "1") != "0"
        self._lock = threading.Lock()  # the graph, between steps and the idle watcher
        self._last_step = 0.0  # when the graph last compiled or stepped
        self._closed = threading.Event()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray and os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)  # a cluster is named: join it
        elif self._owns_ray:  # offline LLM: a private local cluster, a logical CPU per CPU shard
            ray.init(num_cpus=max(os.cpu_count() or 1, args.world_size), include_dashboard=False,
                     logging_level=logging.WARNING)
        self._forward_seconds = 0.0
        try:
            self._start(args, cfg, max_model_len, eos_token_ids)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
               eos_token_ids: tuple[int, ...]) -> None:
        gpu = _wants_gpu(args.device)
        bundles = shard_bundles(args.tensor_parallel_size, args.pipeline_parallel_size, gpu,
                                args.placement_hosts)
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the {args.world_size} shards (TP {args.tensor_parallel_size} x PP "
                f"{args.pipeline_parallel_size}) need bundles {bundles} but the Ray cluster has "
                f"{ray.available_resources()} free after {PLACEMENT_TIMEOUT_S:.0f} s") from None
        # Workers see their own GPU as cuda:0; CPU shards keep `cpu`.
        shard_args = dataclasses.replace(args, device="cuda" if gpu else "cpu")
        actor = ray.remote(ShardWorker)
        self.workers = [
            actor.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.pg, placement_group_bundle_index=rank),
                          ).remote(shard_args, cfg, max_model_len, eos_token_ids, rank)
            for rank in range(args.world_size)]
        init_method = ray.get(self.workers[0].rendezvous_address.remote())
        capacities = ray.get([w.init.remote(init_method) for w in self.workers])
        self.num_kv_blocks = decide_kv_blocks(args, capacities, max_model_len, gpu)
        ray.get([w.allocate_kv_cache.remote(self.num_kv_blocks) for w in self.workers])
        self._sampler_rank = (args.pipeline_parallel_size - 1) * args.tensor_parallel_size
        self._compile()
        if not gpu and self.graph is not None:
            threading.Thread(target=self._tear_down_when_idle, daemon=True,
                             name="flagserve-graph-idle").start()

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode
        if not self._use_graph:
            return
        try:
            with InputNode() as step:
                dag = MultiOutputNode([w.execute.bind(step) for w in self.workers])
            self.graph = dag.experimental_compile()
            self._last_step = time.monotonic()  # idle from now, not from before the model loaded
        except Exception:  # noqa: BLE001 - actor calls do the same job, a little slower
            log.warning("Ray compiled graph unavailable; stepping shards with actor calls",
                        exc_info=True)
            self._use_graph = False

    def _tear_down_when_idle(self) -> None:
        while not self._closed.wait(IDLE_TEARDOWN_S / 2):
            with self._lock:
                if self.graph is not None and time.monotonic() - self._last_step > IDLE_TEARDOWN_S:
                    self.graph.teardown()
                    self.graph = None

    def execute(self, step: StepInput) -> SamplerOutput | None:
        with self._lock:
            if self.graph is None:
                self._compile()
            if self.graph is not None:
                replies = ray.get(self.graph.execute(step), timeout=-1)  # -1: as long as it takes
            else:
                replies = ray.get([w.execute.remote(step) for w in self.workers])
            self._last_step = time.monotonic()
        out, self._forward_seconds = replies[self._sampler_rank]
        return out

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds

    def shutdown(self) -> None:
        self._closed.set()
        if not ray.is_initialized():
            return
        with self._lock:
            if self.graph is not None:
                self.graph.teardown()
                self.graph = None
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._owns_ray:
            ray.shutdown()
