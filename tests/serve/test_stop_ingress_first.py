"""`stop` with a separate ingress deployment: the ingress drains before the engines stop, so
a request that arrives as the stop begins gets the 503 at once, or is served, instead of
waiting for an engine replica until the drain timeout cuts it (serve/server.py,
_drain_ingress)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import requests

from tests.serve.conftest import REPO, free_port, kill_recorded, run_py, tiny_serve_args

DRAIN_S = 10.0  # what a late request waited before the fix
PROMPT_S = 3.0  # a late request's answer, 200 or 503, comes within this
EVERY_S = 0.05


def _late(url: str, got: list) -> None:
    sent = time.monotonic()
    try:
        r = requests.post(f"{url}/v1/completions", timeout=60,
                          json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})
        got.append((time.monotonic() - sent, r.status_code, r.json()))
    except requests.RequestException as err:  # a connection refused once the port closed
        got.append((time.monotonic() - sent, None, repr(err)))


def _stream(url: str, out: dict) -> None:
    r = requests.post(f"{url}/v1/completions", stream=True, timeout=60,
                      json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 300,
                            "stream": True, "ignore_eos": True})
    out["events"] = [line for line in r.iter_lines() if line]


def test_requests_that_arrive_as_stop_begins_get_a_prompt_503(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = tiny_serve_args(tmp_path / "exp", port, "experiment.runner.deploy.ingress=separate",
                           f"experiment.runner.deploy.drain_timeout_s={DRAIN_S}")
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, f"run failed:\n{result.stdout}\n{result.stderr}"
        stream: dict = {}
        threads = [threading.Thread(target=_stream, args=(url, stream))]
        threads[0].start()
        time.sleep(0.3)
        stop = subprocess.Popen([sys.executable, "run.py", *args, "action=stop"], cwd=REPO,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        got: list = []
        start = time.monotonic()
        # Requests every EVERY_S from the moment stop is typed until it is done (or 3 s after
        # the first 503): some reach the ingress just as the stop deletes the application.
        while stop.poll() is None and time.monotonic() - start < 60:
            if any(code == 503 for _, code, _ in got) and time.monotonic() - start > 3:
                break
            threads.append(threading.Thread(target=_late, args=(url, got)))
            threads[-1].start()
            time.sleep(EVERY_S)
        out, _ = stop.communicate(timeout=180)
        for t in threads:
            t.join(timeout=90)
    finally:
        if run_py(*args, "action=stop", timeout=180).returncode != 0:
            kill_recorded(tmp_path / "exp")
    assert stop.returncode == 0 and "no process left" in out, out
    refused = [(s, body) for s, code, body in got if code == 503]
    assert refused, got  # the drain began while requests came
    for seconds, code, body in got:
        assert code in (200, 503, None), (code, body)
        assert seconds < PROMPT_S, (seconds, code, body)  # not DRAIN_S, as before the fix
    assert all("shutting down" in body["error"]["message"] and "drain timeout" not in
               body["error"]["message"] for _, body in refused), refused
    # the stream that was running when stop began finished: the engine served it to its end
    assert stream["events"][-1] == b"data: [DONE]" and b"error" not in stream["events"][-2], \
        stream["events"][-3:]
    print(f"{len(got)} requests during stop: {len(refused)} refused, slowest answer "
          f"{max(s for s, _, _ in got):.2f} s")
