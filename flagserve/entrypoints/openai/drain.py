"""Graceful stop of one ingress replica's HTTP: refuse new requests, let the running ones
finish within the drain timeout, then end what is left properly.

An ASGI wrapper around the OpenAI app (ingress.py wraps it; `stop` runs the drain on every
ingress replica before it deletes the application, else the replica's __del__ does when Ray
Serve stops the replica, README "Actions"). Once draining, every new request gets an
OpenAI-shaped 503 with `Connection: close` (/health too, so load balancers move on).
A request still running when the timeout passes is cancelled: its engine streams abort, and
an SSE stream that has started ends with an error event and `data: [DONE]`; one whose
response has not started gets the 503.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from flagserve.entrypoints.openai.errors import OpenAIError

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Send], Awaitable[None]]
CUT_GRACE_S = 5.0  # after the timeout: how long cancelled requests get to write their end
SHUTTING_DOWN = "the server is shutting down; retry on another replica or after it restarts"


class _Request:
    """One request in flight: its task (to cancel) and how far its response has got."""

    def __init__(self, send: Send):
        self.task = asyncio.current_task()
        self.send = send
        self.started = self.sse = self.ended = self.cut = False

    async def send_message(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers") or [])
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self.send(message)

    async def end(self) -> None:
        """The end of a response cut by the drain timeout."""
        error = OpenAIError(503, f"{SHUTTING_DOWN} (the drain timeout passed)")
        if not self.started:
            await _refuse(self.send, error)
        elif not self.ended:
            tail = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n" if self.sse else ""
            await self.send({"type": "http.response.body", "body": tail.encode(),
                             "more_body": False})


class Drain:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.draining = False
        self.requests: set[_Request] = set()
        self._idle: asyncio.Event | None = None

    async def __call__(self, scope: Message, receive: Callable, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            return await _refuse(send, OpenAIError(503, SHUTTING_DOWN))
        request = _Request(send)
        self.requests.add(request)
        try:
            await self.app(scope, receive, request.send_message)
        except asyncio.CancelledError:
            if not request.cut:
                raise
            request.task.uncancel()  # the cancel was ours: the task goes on to write the end
            await request.end()
        finally:
            self.requests.discard(request)
            if not self.requests and self._idle is not None:
                self._idle.set()

    async def run(self, timeout_s: float) -> tuple[int, int]:
        """Drain: returns (requests that were running, those cut at the timeout)."""
        self.draining = True
        running = len(self.requests)
        self._idle = asyncio.Event()
        if not self.requests:
            return 0, 0
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        left = list(self.requests)
        for request in left:
            request.cut = True
            request.task.cancel()
        if left:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), CUT_GRACE_S)
        return running, len(left)


async def _refuse(send: Send, error: OpenAIError) -> None:
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
