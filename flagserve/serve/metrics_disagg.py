"""Metrics of the engines of a disaggregated module (serve.<id>.disaggregation), on top of
vLLM's names (metrics.py), which every engine of a role carries with a `role` label:

    flagserve:kv_transfer_{sent,received}_bytes_total      KV moved engine to engine
    flagserve:kv_transfer_{sent,received}_requests_total
    flagserve:kv_transfer_failures_total                   fetches failed, offers expired
    flagserve:kv_transfer_receive_seconds_total            decode side: fetch start -> KV in place
    flagserve:ttft_prefill_queue_seconds                   arrival -> scheduled on a prefill replica
    flagserve:ttft_prefill_seconds                         -> its first token (prefill replica)
    flagserve:ttft_kv_transfer_seconds                     -> the decode replica has the KV

The TTFT split is observed by the decode replica from the handoff's times, so it is one
histogram per decode replica; across hosts its transfer part includes the hosts' clock skew.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flagserve.config.schema import Role
from flagserve.engine.kv_transfer.handoff import RequestHandoff

# counter name (without _total) -> (help, EngineStats field)
KV_COUNTERS = {
    "flagserve:kv_transfer_sent_bytes": ("KV cache bytes sent to decode engines.", "kv_sent_bytes"),
    "flagserve:kv_transfer_received_bytes": ("KV cache bytes received from prefill engines.",
                                             "kv_received_bytes"),
    "flagserve:kv_transfer_sent_requests": ("Requests whose KV was sent.", "kv_sent_requests"),
    "flagserve:kv_transfer_received_requests": ("Requests whose KV was received.",
                                                "kv_received_requests"),
    "flagserve:kv_transfer_failures": ("KV transfers that failed (either side), offers that "
                                       "expired unfetched.", "kv_transfer_failures"),
    "flagserve:kv_transfer_receive_seconds": ("Time spent receiving KV (decode side).",
                                              "kv_receive_seconds"),
}
TTFT_SPLIT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TTFT_SPLIT = {
    "flagserve:ttft_prefill_queue_seconds": "Time to first token: arrival to scheduled on a "
                                            "prefill replica.",
    "flagserve:ttft_prefill_seconds": "Time to first token: scheduled to first token on the "
                                      "prefill replica.",
    "flagserve:ttft_kv_transfer_seconds": "Time to first token: first token on the prefill "
                                          "replica to its KV in the decode replica.",
}


def ttft_split(h: RequestHandoff, now: float) -> dict[str, float]:
    """A handed-off request's TTFT parts, once the decode replica has its KV (`now`)."""
    scheduled = h.first_scheduled_time or h.arrival_time
    first = h.first_token_time or scheduled
    return {"flagserve:ttft_prefill_queue_seconds": max(scheduled - h.arrival_time, 0.0),
            "flagserve:ttft_prefill_seconds": max(first - scheduled, 0.0),
            "flagserve:ttft_kv_transfer_seconds": max(now - first, 0.0)}


def with_roles(family: Any, roles: dict[str, Role]) -> Any:
    """`family` with a role label on the samples of the engines that have one (an aggregated
    engine keeps vLLM's labels exactly)."""
    family.samples = [s._replace(labels={**s.labels, "role": roles[s.labels["engine"]]})
                      if s.labels.get("engine") in roles else s for s in family.samples]
    return family


def role_items(items: Iterable[tuple[tuple[str, str], dict]]) -> list[tuple[tuple[str, str], dict]]:
    """The snapshots of engines with a role: only they get the KV transfer metrics."""
    return [(key, snap) for key, snap in items if snap.get("role")]
