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

import uvicorn

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


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
                                log_level="warning", timeout_keep_alive=30, http="h11",
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
