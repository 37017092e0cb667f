"""Engine metrics under vLLM's names, so existing Prometheus dashboards work unchanged.

Each engine replica keeps an EngineMetrics (fed by the step thread) and pushes snapshots
(plain dicts) to the metrics deployment, which renders all replicas in Prometheus format
with the labels vLLM uses (model_name, engine), and `role` on the engines of a disaggregated
module, which also report their KV transfers (metrics_disagg.py).
"""
from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from flagserve.config.schema import Role
from flagserve.engine.core.loop import StepResult
from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.engine.outputs import FinishReason, RequestOutput
from flagserve.engine.stats import EngineStats
from flagserve.serve.metrics_disagg import (
    KV_COUNTERS,
    TTFT_SPLIT,
    TTFT_SPLIT_BUCKETS,
    role_items,
    ttft_split,
    with_roles,
)

# vLLM's buckets, with sub-10ms ones added: the tiny CPU model decodes in about a millisecond.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Time to first token.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Time between consecutive output tokens.", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("End-to-end request latency.", E2E_BUCKETS),
    "vllm:request_queue_time_seconds": ("Time from arrival to first scheduling.", E2E_BUCKETS),
    "vllm:request_prompt_tokens": ("Prompt tokens per request.", TOKEN_BUCKETS),
    "vllm:request_generation_tokens": ("Generated tokens per request.", TOKEN_BUCKETS),
}
GAUGES = {
    "vllm:num_requests_running": "Requests in the running batch.",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled.",
    "vllm:kv_cache_usage_perc": "KV cache usage; 1 means 100 percent.",
}
# counter name (without _total) -> (help, EngineStats field)
COUNTERS = {
    "vllm:prompt_tokens": ("Prefill tokens processed.", "prompt_tokens"),
    "vllm:generation_tokens": ("Generation tokens processed.", "generation_tokens"),
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                  "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    "vllm:num_preemptions": ("Preemptions of running requests.", "num_preemptions"),
    # FlagServe's own (vLLM has no such counter): hit rate = cache_hits / compile_requests.
    "flagserve:structured_output_compile_requests": (
        "Grammars (JSON schema, regex, choice, EBNF) asked of the compiler.",
        "structured_output_compile_requests"),
    "flagserve:structured_output_cache_hits": (
        "Of those, served from the compiled-grammar cache (or a compilation under way).",
        "structured_output_cache_hits"),
}
SUCCESS = "vllm:request_success"  # counter labelled by finished_reason


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass
class _Seen:
    last_token_time: float
    tokens: int = 0


class EngineMetrics:
    """Per-request latency histograms and finish counts of one engine replica."""

    def __init__(self, role: Role | None = None) -> None:
        self.role = role  # prefill | decode; None: an aggregated engine
        self._lock = threading.Lock()
        self._hist = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        if role is not None:
            self._hist.update({name: Histogram(TTFT_SPLIT_BUCKETS) for name in TTFT_SPLIT})
        self._success: Counter[str] = Counter()  # by finished_reason
        self._seen: dict[str, _Seen] = {}

    def on_step(self, result: StepResult) -> None:
        with self._lock:
            for out in result.outputs:
                self._observe(out, result.time)
            # Reported by the engine with the step that applied the abort, after the last
            # output of the request: counted once, and its _seen entry goes with it.
            for request_id in result.aborted:
                self._seen.pop(request_id, None)
                self._success[str(FinishReason.ABORT)] += 1

    def _observe(self, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        seen = self._seen.get(out.request_id)
        metrics = out.metrics
        if seen is None and new_tokens:
            first = metrics.first_token_time if metrics and metrics.first_token_time else now
            if metrics:
                self._hist["vllm:time_to_first_token_seconds"].observe(first - metrics.arrival_time)
                if metrics.first_scheduled_time:
                    self._hist["vllm:request_queue_time_seconds"].observe(
                        metrics.first_scheduled_time - metrics.arrival_time)
            seen = self._seen[out.request_id] = _Seen(now)
        elif seen is not None and new_tokens:
            self._hist["vllm:inter_token_latency_seconds"].observe(now - seen.last_token_time)
            seen.last_token_time = now
        if seen is not None:
            seen.tokens += new_tokens
        # Each sequence once, in the (DELTA) output that carries its end: one that ended in an
        # earlier step is not in the request's last output.
        for c in out.outputs:
            if c.finish_reason is not None:
                self._success[str(c.finish_reason)] += 1  # a label: the plain value
        if out.finished:
            self._seen.pop(out.request_id, None)
            if metrics:
                self._hist["vllm:e2e_request_latency_seconds"].observe(now - metrics.arrival_time)
            self._hist["vllm:request_prompt_tokens"].observe(len(out.prompt_token_ids))
            self._hist["vllm:request_generation_tokens"].observe(seen.tokens if seen else 0)

    def on_handoff_received(self, handoff: RequestHandoff, now: float) -> None:
        """A decode replica has a request's KV: its TTFT split (metrics_disagg.py)."""
        with self._lock:
            for name, seconds in ttft_split(handoff, now).items():
                self._hist[name].observe(seconds)

    def snapshot(self, stats: EngineStats) -> dict:
        with self._lock:
            return {
                "gauges": {"vllm:num_requests_running": stats.num_running,
                           "vllm:num_requests_waiting": stats.num_waiting,
                           "vllm:kv_cache_usage_perc": stats.kv_cache_usage},
                "counters": {name: getattr(stats, attr)
                             for name, (_, attr) in (COUNTERS | KV_COUNTERS).items()},
                "role": self.role,
                "success": dict(self._success),
                "histograms": {name: (list(h.counts), h.total) for name, h in self._hist.items()},
            }


class _SnapshotCollector:
    def __init__(self, snapshots: dict[tuple[str, str], dict]):
        self.snapshots = snapshots  # (model_name, engine) -> snapshot

    def collect(self):
        items = sorted(self.snapshots.items())
        roles = {engine: snap["role"] for (_, engine), snap in items if snap.get("role")}
        for family in self._families(items, role_items(items)):
            yield with_roles(family, roles)

    def _families(self, items: list, split: list):
        labels = ["model_name", "engine"]
        for name, doc in GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for key, snap in items:
                fam.add_metric(list(key), snap["gauges"][name])
            yield fam
        for name, (doc, _), chosen in [*((n, v, items) for n, v in COUNTERS.items()),
                                       *((n, v, split) for n, v in KV_COUNTERS.items() if split)]:
            fam = CounterMetricFamily(name, doc, labels=labels)
            for key, snap in chosen:
                fam.add_metric(list(key), snap["counters"][name])
            yield fam
        fam = CounterMetricFamily(SUCCESS, "Finished requests by finish reason.",
                                  labels=labels + ["finished_reason"])
        for key, snap in items:
            for reason in sorted(set(snap["success"]) | {str(r) for r in FinishReason}):
                fam.add_metric([*key, reason], snap["success"].get(reason, 0))
        yield fam
        for name, (doc, bounds) in HISTOGRAMS.items():
            yield _histogram(name, doc, bounds, items)
        for name, doc in TTFT_SPLIT.items() if split else ():
            yield _histogram(name, doc, TTFT_SPLIT_BUCKETS, split)


def _histogram(name: str, doc: str, bounds: tuple[float, ...], items: list) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
    for key, snap in items:
        counts, total = snap["histograms"][name]
        cumulative, running = [], 0
        for bound, count in zip([*map(str, bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        fam.add_metric(list(key), cumulative, total)
    return fam


def render(snapshots: dict[tuple[str, str], dict], extra: Iterable[Any] = ()) -> bytes:
    """The engines' snapshots, and any `extra` collectors (the routers'), in Prometheus format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshots))
    for collector in extra:
        registry.register(collector)
    return generate_latest(registry)
