"""serve.<id>.router on Ray Serve's request-router extension point: every DeploymentHandle
to an engine deployment (the ingress's RemoteEngine) picks replicas with an EngineRouter.

Why Serve's router and not a router of our own in front of the replicas: Serve keeps the
replica set current as autoscaling adds and drains replicas, enforces max_ongoing_requests
(a full replica refuses, the next rank is tried), counts the requests autoscaling scales on,
and delivers each replica's load (its record_routing_stats) to every caller. What it lacks
is the policy, which strategy.py supplies.

It runs in the caller, which has tokenized the prompt: the EngineRequest in the call's
arguments carries the token ids, hashed by the engine's own block hash. Calls without one
(info, ping) go to the least loaded replica and are not counted.
"""
from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from flagserve.config.schema import RouterConfig
from flagserve.serve.metrics_hub import HUB_NAME, push_forever, start_pusher
from flagserve.serve.metrics_router import RouterCounts
from flagserve.serve.routing.prefix import prefix_hashes
from flagserve.serve.routing.strategy import Decision, ReplicaLoad, load, make_strategy

log = logging.getLogger(__name__)
PENDING_LIMIT = 10_000  # decisions awaiting their routing; a cancelled request's is dropped later


class EngineRouter(RequestRouter):
    def initialize_state(self, router: dict[str, Any], block_size: int, model_name: str) -> None:
        config = RouterConfig(**router)
        self.strategy = make_strategy(config)
        self.block_size, self.prefix_blocks = block_size, config.prefix_blocks
        self.kv_usage_weight = config.kv_usage_weight
        self.counts = RouterCounts(model_name, config.strategy)
        self._decided: OrderedDict[str, tuple[Decision, list[int]]] = OrderedDict()
        self._reporter: Any = None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
        ranked = sorted(candidate_replicas,
                        key=lambda r: load(loads[r.replica_id.unique_id], self.kv_usage_weight))
        prefix = self._prompt_prefix(pending_request)
        if prefix is None or pending_request is None:
            return [ranked]
        decision = self.strategy.choose(list(loads.values()), prefix)
        # Recorded now, not once routed: the rest of a burst of a new prefix, chosen before
        # the first is sent, then follows it instead of spreading by load.
        self.strategy.routed(decision.replica, prefix)
        self._decided[pending_request.metadata.internal_request_id] = (decision, prefix)
        while len(self._decided) > PENDING_LIMIT:
            self._decided.popitem(last=False)
        chosen = next(r for r in ranked if r.replica_id.unique_id == decision.replica)
        # The chosen replica may refuse (max_ongoing_requests): then the least loaded other.
        return [[chosen], [r for r in ranked if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        entry = self._decided.pop(pending_request.metadata.internal_request_id, None)
        if entry is None:
            return
        decision, prefix = entry
        replica = replica_id.unique_id
        if replica != decision.replica:  # the chosen one was full: another holds it now
            self.strategy.routed(replica, prefix)
        self.counts.add(replica, decision.outcome if decision.replica == replica else "fallback")
        if self._reporter is None:
            self._reporter = start_pusher(self._event_loop, self._report())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {rid.unique_id for rid in self._replica_id_set} - {r.replica_id.unique_id
                                                                  for r in replicas}
        super().update_replicas(replicas)
        for replica in gone:
            self.strategy.forget(replica)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        """Serve's count of the replica's ongoing requests (fresh for this caller's own sends)
        or the engine's running + waiting (up to stats_period_s old), whichever is higher."""
        stats = replica.routing_stats or {}
        queued = self._replica_queue_len_cache.get(replica.replica_id) or 0
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        return ReplicaLoad(replica.replica_id.unique_id, max(queued, reported),
                           float(stats.get("kv_usage", 0.0)))

    def _prompt_prefix(self, pending_request: PendingRequest | None) -> list[int] | None:
        for arg in pending_request.args if pending_request is not None else ():
            tokens = getattr(arg, "prompt_token_ids", None)
            if tokens is not None:
                return prefix_hashes(tokens, self.block_size, self.prefix_blocks)
        return None

    async def _report(self) -> None:
        from ray import serve

        hub = serve.get_deployment_handle(HUB_NAME, app_name=self._deployment_id.app_name)
        key = (self.counts.model_name, uuid.uuid4().hex)
        await push_forever(self.counts.snapshot, lambda snap: hub.push_router.remote(key, snap))
