"""The placement group of one model replica: one bundle per shard (device), rank order.

Bundle i holds global rank i, so the TP ranks of a stage are consecutive bundles; PACK keeps
them together where they fit. A host list (one address per pipeline stage) pins each stage
to a node through the custom resource every node of a multi-host cluster advertises.
"""
from __future__ import annotations

HOST_RESOURCE_AMOUNT = 0.001  # a token amount: many shards may name the same host


def host_resource(address: str) -> str:
    """The Ray custom resource a node started for `address` advertises (multi-host runner)."""
    return f"host:{address}"


def shard_bundles(tp_size: int, pp_size: int, use_gpu: bool,
                  stage_hosts: list[str] | None = None) -> list[dict[str, float]]:
    bundles = []
    for stage in range(pp_size):
        bundle: dict[str, float] = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        if stage_hosts:
            bundle[host_resource(stage_hosts[stage])] = HOST_RESOURCE_AMOUNT
        bundles += [dict(bundle) for _ in range(tp_size)]
    return bundles
