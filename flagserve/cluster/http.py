"""Tiny HTTP helpers for run/status/test and the benchmarks (stdlib only: no client library
in the launcher)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

WILDCARD_BINDS = ("0.0.0.0", "::")


def url_of(bind: str, port: int, wildcard_via: str = "127.0.0.1") -> str:
    """The URL of a server bound to `bind`. A wildcard bind listens on every interface, so
    it is reached at `wildcard_via`: loopback on its own host, its address from elsewhere."""
    host = wildcard_via if bind in WILDCARD_BINDS else bind
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # IPv6 in brackets


def request(url: str, body: dict[str, Any] | None = None, api_key: str | None = None,
            timeout: float = 10.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def get(url: str, api_key: str | None = None, timeout: float = 10.0) -> bytes:
    """The body of GET `url`; OSError unless it answers 200."""
    code, body = request(url, api_key=api_key, timeout=timeout)
    if code != 200:
        raise OSError(f"GET {url}: HTTP {code}: {body[:200]!r}")
    return body


def healthy(endpoint: str, timeout: float = 5.0) -> bool:
    try:
        return request(f"{endpoint}/health", timeout=timeout)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(endpoint: str, timeout: float, alive: Any = lambda: True,
                 tick: Any = lambda: None) -> bool:
    """Poll /health until it answers 200, `alive()` turns false, or `timeout` passes;
    `tick()` after every poll (progress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if healthy(endpoint):
            tick()
            return True
        tick()
        if not alive():
            return False
        time.sleep(0.5)
    return False
