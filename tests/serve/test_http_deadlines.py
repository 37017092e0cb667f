"""The replica's own HTTP server (deploy.http_server: replicas) bounds how long a request may
take to arrive: a client that never finishes its headers, or stalls its body, loses its
connection, and the server keeps serving everyone else."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from flagserve.entrypoints.openai import http_server
from tests.serve.conftest import free_port


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_server, "BODY_IDLE_S", 0.5)
    port = free_port()
    loop = asyncio.new_event_loop()
    direct = http_server.DirectHTTPServer("127.0.0.1", port, 8192)
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.call_soon(lambda: (direct.start(app), ready.set()))  # on the running loop
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield port
    asyncio.run_coroutine_threadsafe(direct.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.recv(1024)


@pytest.mark.parametrize("sent", [
    b"",  # a connection that never sends its request
    b"GET / HTTP/1.1\r\nHost: x\r\n",  # headers never finished
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # a body that stalls
])
def test_an_unfinished_request_loses_its_connection(server, sent):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as sock:
        sock.sendall(sent)
        assert closed_within(sock, 5.0)
    assert get(server).startswith(b"HTTP/1.1 200")


def test_slow_headers_are_cut_at_the_deadline_though_bytes_keep_coming(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        start = time.monotonic()
        for _ in range(20):  # a header line every 0.2 s: never idle, never done
            try:
                sock.sendall(b"X-A: b\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.2)
        assert closed_within(sock, 5.0) and time.monotonic() - start < 3.0


def test_a_body_that_keeps_coming_is_not_cut(server):
    with socket.create_connection(("127.0.0.1", server), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close\r\n\r\n")
        for _ in range(8):  # 2 s in all, each byte within the body's idle deadline
            sock.sendall(b"a")
            time.sleep(0.25)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
