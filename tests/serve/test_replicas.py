"""Two engine replicas on one host, both in /metrics from the start and both listening on the
configured port (SO_REUSEPORT; `ingress: engine`, which auto no longer picks for several
replicas): new connections reach both, and stop leaves nothing."""
from __future__ import annotations

import re
import time

import requests

from tests.serve.conftest import free_port, kill_recorded, run_py, tiny_serve_args


def metric_engines(url: str, name: str, timeout_s: float = 15.0) -> set[str]:
    """The engine labels of `name` in /metrics, once two replicas show (or the timeout)."""
    engines: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(engines) < 2 and time.monotonic() < deadline:
        text = requests.get(f"{url}/metrics", timeout=10).text
        engines = set(re.findall(rf'{name}\{{engine="([^"]+)"', text))
        time.sleep(0.5)
    return engines


def test_two_replicas_share_the_port(tmp_path):
    port = free_port()
    args = tiny_serve_args(tmp_path, port, "serve.llm.resources.num_replicas=2",
                           "experiment.runner.deploy.ingress=engine",
                           "serve.llm.engine_args.max_model_len=256",
                           "serve.llm.engine_args.cpu_kv_cache_space_gib=0.05")
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        url = f"http://127.0.0.1:{port}"
        assert len(metric_engines(url, "vllm:num_requests_running")) == 2  # before any request
        for _ in range(30):  # one connection per request: the kernel picks a replica per connection
            with requests.Session() as s:
                r = s.post(f"{url}/v1/completions", timeout=60,
                           json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
        served: dict[str, float] = {}
        for _ in range(20):  # replicas push their metrics every 0.5 s
            text = requests.get(f"{url}/metrics", timeout=10).text
            served = {engine: float(n) for engine, n in re.findall(
                r'vllm:request_success_total\{engine="([^"]+)",finished_reason="length"[^}]*\} (\S+)', text)}
            if sum(served.values()) == 30:
                break
            time.sleep(0.5)
        assert len(served) == 2 and sum(served.values()) == 30, served
        assert min(served.values()) > 0, served  # both replicas took connections
    finally:
        stop = run_py(*args, "action=stop", timeout=120)
        if stop.returncode != 0:
            kill_recorded(tmp_path)
