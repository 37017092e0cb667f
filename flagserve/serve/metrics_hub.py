"""The metrics deployment (one replica): latest snapshot of every engine replica -> /metrics.

Engine replicas push; a scrape of /metrics on any ingress replica then sees all engines,
however many replicas autoscaling has started.
"""
from __future__ import annotations

import time

from flagserve.serve.metrics import render

STALE_AFTER_S = 60.0  # a replica that stopped pushing (scaled down, crashed) drops out


class MetricsHub:
    def __init__(self) -> None:
        self.snapshots: dict[tuple[str, str], tuple[float, dict]] = {}

    async def push(self, key: tuple[str, str], snapshot: dict) -> None:
        self.snapshots[tuple(key)] = (time.monotonic(), snapshot)

    async def render(self) -> bytes:
        now = time.monotonic()
        live = {k: s for k, (t, s) in self.snapshots.items() if now - t < STALE_AFTER_S}
        return render(live)
