"""The replica's own HTTP server (deploy.http_server: replicas): clients reach the ingress
without Ray Serve's proxy in between.

Why (the proxy's extra processes and Ray calls per request): README, "The serving graph".
Every replica on a host binds the same host:port with SO_REUSEPORT and the kernel spreads
new connections across them, as Ray Serve's own proxies and vLLM's API servers do.

It parses HTTP with h11, whose buffer for a request line and headers not yet complete is
bounded (deploy.limits.max_header_bytes; past it the connection gets a 400 and is closed;
headers that arrive whole in one read get a 431 from size_limits.py). httptools, uvicorn's
faster default, has no such bound: a client could grow one header without end.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0
# A request's line and headers must arrive whole within HEAD_TIMEOUT_S of its first byte (of
# the connection, for its first request), and its body may pause at most BODY_IDLE_S between
# reads (nginx's client_header_timeout and client_body_timeout): uvicorn bounds neither, and
# a client that never finishes a request held its connection for good (a slow-header client
# needs no API key, and 20,000 of them took every descriptor, /health's too).
HEAD_TIMEOUT_S = 30.0
BODY_IDLE_S = 30.0


class _DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadlines above; past one the connection closes
    (the app sees a disconnect)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_body = False
        self._watch(arrived=False)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(arrived=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self, arrived: bool) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if arrived or not self._reading_body:  # each read restarts the body's clock
                self._arm(BODY_IDLE_S, body=True)
        elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            if self._deadline is None:  # a request begun (or awaited on a new connection)
                self._arm(HEAD_TIMEOUT_S, body=False)
        else:  # read whole, or idle between requests (uvicorn's keep-alive timeout then)
            self._disarm()

    def _arm(self, seconds: float, body: bool) -> None:
        self._disarm()
        self._reading_body = body
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the replica's SIGTERM/SIGINT stay Ray's: the replica stops the server itself


class DirectHTTPServer:
    def __init__(self, host: str, port: int, max_header_bytes: int):
        self.host, self.port, self.max_header_bytes = host, port, max_header_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind((host, port))
        except OSError as err:
            self.sock.close()
            raise RuntimeError(f"cannot listen on {host}:{port}: {err.strerror}; another "
                               "program holds the port (experiment.runner.deploy.port)") from None
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None

    def start(self, app: Any) -> None:
        """Serve `app` on the running event loop (the replica's)."""
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None,
                                log_level="warning", timeout_keep_alive=30,
                                http=_DeadlineH11Protocol,
                                h11_max_incomplete_event_size=self.max_header_bytes)
        self.server = _Server(config)
        # Listen now, not when the serve task first runs: the replica reports ready when this
        # returns, and a socket not yet listening gets no share of SO_REUSEPORT's connections
        # (a busy loop left one of two replicas out of 30 connections in CI).
        self.sock.listen(config.backlog)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        self.task.add_done_callback(self._on_exit)
        log.info("serving HTTP on %s:%d", self.host, self.port)

    def _on_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the HTTP server stopped", exc_info=task.exception())

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True  # finishes the responses in flight, then returns
            try:
                await asyncio.wait_for(self.task, STOP_TIMEOUT_S)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down anyway
                self.task.cancel()
        self.sock.close()
