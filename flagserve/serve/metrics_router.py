"""The routers' decisions on /metrics: how many requests each strategy sent to each engine
replica, and why (flagserve/serve/routing/strategy.py, Outcome).

    flagserve:router_decisions_total{model_name, engine, strategy, outcome}

Each router (one per calling ingress replica) counts in a RouterCounts and pushes its
snapshot to the metrics deployment, which sums the routers of a model.
"""
from __future__ import annotations

from collections import Counter

from prometheus_client.core import CounterMetricFamily

DECISIONS = "flagserve:router_decisions"


class RouterCounts:
    def __init__(self, model_name: str, strategy: str):
        self.model_name = model_name
        self.strategy = strategy
        self._counts: Counter[tuple[str, str]] = Counter()  # (engine replica, outcome) -> n

    def add(self, engine: str, outcome: str) -> None:
        self._counts[engine, outcome] += 1

    def snapshot(self) -> dict:
        return {"strategy": self.strategy,
                "counts": [[engine, outcome, n] for (engine, outcome), n in sorted(self._counts.items())]}


class RouterCollector:
    def __init__(self, snapshots: dict[tuple[str, str], dict]):
        self.snapshots = snapshots  # (model_name, router id) -> RouterCounts.snapshot()

    def collect(self):
        totals: Counter[tuple[str, str, str, str]] = Counter()
        for (model_name, _), snap in self.snapshots.items():
            for engine, outcome, n in snap["counts"]:
                totals[model_name, engine, snap["strategy"], outcome] += n
        fam = CounterMetricFamily(DECISIONS, "Requests routed to an engine replica, by strategy "
                                  "and outcome (affinity, overload, balance, least_loaded, "
                                  "round_robin, fallback).",
                                  labels=["model_name", "engine", "strategy", "outcome"])
        for labels, n in sorted(totals.items()):
            fam.add_metric(list(labels), n)
        yield fam
