"""The OpenAI server without Ray: the ingress on its own uvicorn server over a real engine
(`serving`), and `url`, one such server on the tiny model per module."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from flagserve.entrypoints.openai.ingress import ModelRoute, OpenAIIngress
from flagserve.serve.engine_clients import LocalEngineSpec
from tests.serve.conftest import free_port


@contextlib.contextmanager
def serving(model: str, core: str) -> Iterator[str]:
    port = free_port()
    loop = asyncio.new_event_loop()
    built = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        engine = LocalEngineSpec("llm", "m", {"model": model, "max_model_len": 512, "max_num_seqs": 4}, core)
        built["ingress"] = ingress = OpenAIIngress([ModelRoute("llm", ["m"], engine, model, None, [])],
                                                   None, None, ("127.0.0.1", port))
        loop.run_until_complete(ingress.__serve_build_asgi_app__())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 180
    while time.time() < deadline:
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(url + "/health", timeout=1).status_code == 200:
                break
        time.sleep(0.2)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(built["ingress"].http.stop(), loop).result(10)
        built["ingress"].engines["llm"].shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def url(llama_path) -> Iterator[str]:
    """The tiny model's engine on a thread, behind its own server."""
    with serving(llama_path, "thread") as u:
        yield u
