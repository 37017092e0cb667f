"""Autoscaling of a disaggregated module's roles on their own load (serve.<id>.disaggregation.
<role>.min_replicas / max_replicas).

Serve's default policy counts a replica's ongoing Serve calls, which misjudges both roles: a
prefill call stays open after its handoff until the decode side has the KV (so idle prefill
replicas look busy), and one call can be a 20-token prompt or a 20k-token one. Each role's
replicas report what they are short of instead (`record_autoscaling_stats`, pushed to Serve's
controller with every metrics push): decode replicas the requests their engines hold (running
+ waiting for blocks), prefill replicas the prompt tokens their engines have yet to compute.
`LoadPolicy` asks for sum / target replicas; Serve's wrapper around every custom policy then
applies min/max_replicas, the up/downscale delays and the scaling factors.

Scale-down drains: Serve stops routing to a replica it removes and waits until its ongoing
calls end (graceful_shutdown_timeout_s, app.py shutdown_options) before the replica's
destructor stops its engine. A decode stream is one call and a prefill call lasts until its
KV has been fetched, so a removed replica finishes what it holds.
"""
from __future__ import annotations

import math
from typing import Any

from flagserve.config.topology import RoleScaling
from flagserve.engine.stats import EngineStats

POLICY = f"{__name__}:LoadPolicy"


class LoadPolicy:
    """Serve's custom autoscaling policy (a class: Serve builds it once with policy_kwargs)."""

    def __init__(self, metric: str, target: float):
        self.metric, self.target = metric, target

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        """ctx: Serve's AutoscalingContext; aggregated_metrics holds each running replica's
        reported values, averaged over look_back_period_s."""
        reported = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        if not reported:  # no replica has reported yet (starting): keep the current target
            return ctx.target_num_replicas, {}
        return desired_replicas(sum(reported.values()), self.target), {}


def desired_replicas(load: float, target: float) -> int:
    """Replicas that carry `load` at `target` each (0 when idle: Serve bounds it by min)."""
    return math.ceil(load / target - 1e-9)


def autoscaling_options(scaling: RoleScaling) -> dict[str, Any]:
    """What an autoscaled role adds to Serve's autoscaling_config."""
    return {"policy": {"policy_function": POLICY,
                       "policy_kwargs": {"metric": scaling.metric, "target": scaling.target}}}


def load_report(stats: EngineStats) -> dict[str, float]:
    """Both roles' metrics from an engine's stats (ScaleMetric names)."""
    return {"running_requests": stats.num_running + stats.num_waiting,
            "queued_prompt_tokens": stats.queued_prompt_tokens}
