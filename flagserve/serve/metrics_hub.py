"""The metrics deployment (one replica): latest snapshot of every engine replica and every
router -> /metrics.

Engine replicas and routers push; a scrape of /metrics on any ingress replica then sees all
of them, however many replicas autoscaling has started.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

from flagserve.serve.metrics import render
from flagserve.serve.metrics_router import RouterCollector

log = logging.getLogger(__name__)
HUB_NAME = "metrics"  # the deployment's name in the application
STALE_AFTER_S = 60.0  # a replica that stopped pushing (scaled down, crashed) drops out
PUSH_INTERVAL_S = 0.5
HEARTBEAT_S = 10.0  # pushed unchanged this often, so the hub knows the pusher is alive


class MetricsHub:
    def __init__(self) -> None:
        self.snapshots: dict[tuple[str, str], tuple[float, dict]] = {}
        self.routers: dict[tuple[str, str], tuple[float, dict]] = {}

    async def push(self, key: tuple[str, str], snapshot: dict) -> None:
        self.snapshots[tuple(key)] = (time.monotonic(), snapshot)

    async def push_router(self, key: tuple[str, str], snapshot: dict) -> None:
        self.routers[tuple(key)] = (time.monotonic(), snapshot)

    async def render(self) -> bytes:
        return render(_live(self.snapshots), [RouterCollector(_live(self.routers))])


def _live(pushed: dict[tuple[str, str], tuple[float, dict]]) -> dict[tuple[str, str], dict]:
    """The snapshots pushed within STALE_AFTER_S; older ones are dropped, each with a log line
    (its series end in /metrics: the operator should know why)."""
    now = time.monotonic()
    for key in [k for k, (t, _) in pushed.items() if now - t >= STALE_AFTER_S]:
        del pushed[key]
        log.warning("metrics of %s replica %s dropped from /metrics: no push for %.0f s "
                    "(scaled down, restarted or stuck)", *key, STALE_AFTER_S)
    return {k: s for k, (_, s) in pushed.items()}


def start_pusher(loop: asyncio.AbstractEventLoop, pusher: Coroutine) -> asyncio.Task:
    """Run `pusher` (push_forever) on `loop` outside any request's context. A task started
    while serving a request inherits Serve's request context, and Serve cancels the calls made
    under it when that request is cancelled (every prefill call is, once its KV has moved):
    the push under way would be cancelled, and with it the pusher, for good."""
    return loop.create_task(pusher, context=contextvars.Context())


async def push_forever(snapshot: Callable[[], dict], push: Callable[[dict], Awaitable]) -> None:
    """Push `snapshot()` on change, and as a heartbeat; failures are logged, never raised."""
    last, last_time = None, 0.0
    while True:
        snap = snapshot()
        if snap != last or time.monotonic() - last_time > HEARTBEAT_S:
            try:
                await push(snap)
                last, last_time = snap, time.monotonic()
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this pusher is being stopped
                log.warning("a metrics push was cancelled; pushing again")
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.warning("pushing metrics failed", exc_info=True)
        await asyncio.sleep(PUSH_INTERVAL_S)
