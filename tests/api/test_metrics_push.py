"""The metrics pushers of engine replicas and routers (serve/metrics_hub.py) outlive the
requests they start under: Serve cancels a cancelled request's calls, and every prefill call
is cancelled once its KV has moved (a pusher that died left a prefill replica off /metrics)."""
from __future__ import annotations

import asyncio
import contextvars

import pytest

from flagserve.serve import metrics_hub
from flagserve.serve.metrics_hub import push_forever, start_pusher

REQUEST = contextvars.ContextVar("request", default=None)


def test_a_cancelled_push_does_not_stop_the_pusher(monkeypatch):
    monkeypatch.setattr(metrics_hub, "PUSH_INTERVAL_S", 0.01)
    pushed, seen = [], []

    async def push(snap):
        seen.append(REQUEST.get())
        if len(seen) == 1:
            raise asyncio.CancelledError  # Serve cancelled this call with its request
        pushed.append(snap)

    async def main():
        REQUEST.set("a request being served")
        task = start_pusher(asyncio.get_running_loop(), push_forever(lambda: "snapshot", push))
        while not pushed:
            await asyncio.sleep(0.01)
        task.cancel()  # stopping the pusher itself still stops it
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert pushed[0] == "snapshot" and len(seen) >= 2
    assert set(seen) == {None}  # the pusher runs outside the request's context
