"""One real deployment (run.py action=run in the background), exercised over real HTTP with
the official openai client, then status and stop. Tests run in file order; the last stops it."""
from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest
import requests

from tests.serve.conftest import API_KEY
from tests.serve.raw_http import exchange, request_head

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=API_KEY, max_retries=0)


def post(deployment, route: str, body, key: str | None = API_KEY, raw: bool = False):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw:
        return requests.post(f"{deployment.url}{route}", data=body, headers={
            **headers, "Content-Type": "application/json"}, timeout=60)
    return requests.post(f"{deployment.url}{route}", json=body, headers=headers, timeout=60)


def metrics(deployment) -> dict[str, float]:
    text = requests.get(f"{deployment.url}/metrics", timeout=10,
                        headers={"Authorization": f"Bearer {API_KEY}"}).text
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(vllm:\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        reason = re.search(r'finished_reason="(\w+)"', labels or "")
        key = name + ("{" + reason.group(1) + "}" if reason else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_run_prints_endpoint_and_curl(deployment):
    assert f"{deployment.url}/v1" in deployment.run_output
    assert "curl " in deployment.run_output and "/v1/chat/completions" in deployment.run_output
    for name in ("config.yaml", "logs/server.log", "run/processes.json", "run/ray.json"):
        assert (deployment.exp_dir / name).exists(), name


def test_cli_overrides_take_effect(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5,
                                    temperature=0)
    choice = out.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert 1 <= out.usage.completion_tokens <= 6


def test_streams_match_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="The weather today", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                               temperature=0).choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == chat_full


def test_n2_and_seed(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                    temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, n=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_vllm_extra_fields_and_stop(client):
    out = client.completions.create(model=MODEL, prompt="a b c", max_tokens=6, temperature=0,
                                    extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                                "ignore_eos": True, "min_tokens": 6})
    assert out.usage.completion_tokens == 6
    text = out.choices[0].text
    if len(text.strip()) > 2:
        stop = text.strip()[:2]
        cut = client.completions.create(model=MODEL, prompt="a b c", max_tokens=6, temperature=0,
                                        stop=[stop], extra_body={"top_k": 5, "min_p": 0.1,
                                                                 "repetition_penalty": 1.1})
        assert stop not in cut.choices[0].text


def test_many_concurrent_streams_share_the_batch(deployment):
    import asyncio

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key=API_KEY)

        async def one(i):
            stream = await client.completions.create(model=MODEL, prompt=f"Request {i}",
                                                     max_tokens=16, stream=True, temperature=0,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return await asyncio.gather(*(one(i) for i in range(12)))

    assert len(asyncio.run(main())) == 12


@pytest.mark.parametrize("name,body,status", [
    ("malformed json", b'{"model": "tiny-test", "prompt": ', 400),
    ("not an object", b'[1, 2]', 400),
    ("wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400),
    ("max_tokens < 1", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("negative temperature", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("prompt too long", {"model": MODEL, "prompt": "hello " * 600, "max_tokens": 4}, 400),
    ("prompt + max_tokens too long", {"model": MODEL, "prompt": "hello", "max_tokens": 600}, 400),
    ("token id out of vocab", {"model": MODEL, "prompt": [1, 99999999]}, 400),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, 404),
    ("no api key", {"model": MODEL, "prompt": "hi"}, 401),
])
def test_bad_requests(deployment, name, body, status):
    route = "/v1/completions"
    raw = isinstance(body, bytes)
    r = post(deployment, route, body, key=None if name == "no api key" else API_KEY, raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]


def test_bad_chat_requests_and_server_keeps_serving(deployment, client):
    r = post(deployment, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400
    r = post(deployment, "/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).choices


def test_values_that_killed_the_engine_are_400_and_it_keeps_serving(deployment, client):
    """Issue 12: a seed past int64 failed the engine's step (every request, 12-15 s down)."""
    for body, param in (({"seed": 2**64}, "seed"), ({"top_k": 2**62}, "top_k"),
                        ({"stop_token_ids": [2**70]}, "stop_token_ids"), ({"n": 10**6}, "n"),
                        ({"prompt": "a\ud800"}, "prompt")):
        r = post(deployment, "/v1/completions", {"model": MODEL, "prompt": "hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    body = b'{"model": "tiny-test", "prompt": "hi", "temperature": Infinity}'
    r = post(deployment, "/v1/completions", body, raw=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).choices


def test_a_huge_body_is_refused_before_it_is_read(deployment):
    start = time.perf_counter()
    answer, _ = exchange(deployment.url, request_head("/v1/completions", API_KEY,
                                                      f"Content-Length: {50 * 2**20}"))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert time.perf_counter() - start < 2.0
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    answer, sent = exchange(deployment.url, request_head("/v1/completions", API_KEY,
                                                         "Transfer-Encoding: chunked"), [chunk] * 800)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    if deployment.path == "direct":  # Ray Serve's proxy reads a chunked body whole first
        assert sent < 40 * 2**20, sent


def test_every_path_but_health_needs_the_key_and_errors_are_openai_shaped(deployment):
    for path in ("/docs", "/openapi.json", "/v1/nope", "/v1/models", "/metrics"):
        r = requests.get(f"{deployment.url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, (path, r.text)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, status in (("/docs", 404), ("/v1/nope", 404), ("/v1/completions", 405)):
        r = requests.get(f"{deployment.url}{path}", headers=auth, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == status, (path, r.text)


def test_health_is_open_and_metrics_need_the_key(deployment):
    assert requests.get(f"{deployment.url}/health", timeout=10).status_code == 200
    assert requests.get(f"{deployment.url}/metrics", timeout=10).status_code == 401
    assert requests.get(f"{deployment.url}/v1/models", timeout=10).status_code == 401


def test_metrics_use_vllm_names(deployment):
    deadline = time.time() + 10
    while True:
        m = metrics(deployment)
        if m.get("vllm:generation_tokens_total", 0) > 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:time_to_first_token_seconds_count"] > 0


def _settled(deployment) -> dict[str, float]:
    """The metrics once nothing runs and the token count stopped moving (30 s at most)."""
    last, deadline = None, time.time() + 30
    while time.time() < deadline:
        m = metrics(deployment)
        if last is not None and m["vllm:num_requests_running"] == 0 and \
                m["vllm:generation_tokens_total"] == last["vllm:generation_tokens_total"]:
            return m
        last = m
        time.sleep(1.0)  # two metrics pushes
    pytest.fail(f"still generating after 30 s: {last}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_kv(deployment, stream):
    before = metrics(deployment)
    body = {"model": MODEL, "prompt": "Go on forever", "max_tokens": 400, "ignore_eos": True,
            "stream": stream}
    if not stream:
        # A whole-answer request left at once: the server must not generate its 8 x 500 tokens
        # for nobody (it cancels the handler on the disconnect, or never starts the request).
        body.update(n=8, max_tokens=500)
        host, port = deployment.url.removeprefix("http://").split(":")
        data = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request_head("/v1/completions", API_KEY, f"Content-Length: {len(data)}") + data)
            time.sleep(0.1)
        m = _settled(deployment)
        generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        assert generated < 8 * 500 and m["vllm:kv_cache_usage_perc"] == 0, m
        return
    r = requests.post(f"{deployment.url}/v1/completions", stream=True, timeout=60, json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    lines = r.iter_lines()
    assert next(lines).startswith(b"data: ")
    r.close()  # the client goes away mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        m = metrics(deployment)
        if (m.get("vllm:request_success_total{abort}", 0) >
                before.get("vllm:request_success_total{abort}", 0)
                and m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"request not aborted: {m}")


def test_user_module_preprocesses_requests(deployment):
    def prompt_tokens(text):
        r = post(deployment, "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    # The retriever adds a system message with a fact only when a keyword matches.
    assert prompt_tokens("what is flagserve?") >= prompt_tokens("what is flagship?") + 10


def test_dead_engine_process_gives_503_then_the_replica_is_replaced(deployment):
    if deployment.path != "direct":
        pytest.skip("engine_core=thread: there is no engine process to kill")
    import signal

    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import session_members

    def cores():
        members = session_members(load_processes(ExpPaths(deployment.exp_dir))[0])
        return [p for p in members if "flagserve.engine.core.process" in " ".join(p.cmdline())]

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    (old,) = cores()
    old.send_signal(signal.SIGKILL)
    old.wait(10)
    r = post(deployment, "/v1/completions", body)
    assert r.status_code == 503 and "restarting" in r.json()["error"]["message"], r.text
    deadline = time.time() + 90  # 3 failed health checks 2 s apart, then a new replica loads
    while time.time() < deadline:
        try:
            r = post(deployment, "/v1/completions", body)
            if r.status_code == 200:
                break
        except requests.ConnectionError:
            pass  # between the old replica and the new one
        time.sleep(1)
    assert r.status_code == 200, r.text
    (new,) = cores()
    assert new.pid != old.pid


def test_replicas_and_engine_run_at_the_servers_priority(deployment):
    """Ray starts its workers at nice 15 unless told otherwise: a CPU engine would yield its
    cores to every other process of the host."""
    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import session_members

    (server, *_) = load_processes(ExpPaths(deployment.exp_dir))
    members = session_members(server)
    workers = [p for p in members if p.name().startswith("ray::ServeReplica")
               or "flagserve.engine.core.process" in " ".join(p.cmdline())]
    assert len(workers) >= 2, [p.name() for p in members]
    leader = next(p for p in members if p.pid == server.pid)
    assert {p.nice() for p in workers} == {leader.nice()}, [(p.name(), p.nice()) for p in workers]


def test_status_reports_deployments(deployment):
    result = deployment.run_py("status")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "healthy" in out and "RUNNING" in out
    names = ["llm-engine", "retriever", "metrics"]
    if deployment.path == "proxied":
        names.append("ingress")
    else:  # the engine replica is the ingress
        assert not re.search(r"^\s+ingress\s", out, re.M), out
    for name in names:
        assert re.search(rf"{name}\s+HEALTHY\s+replicas: 1 running", out), out
    assert "llm-tokenizer" not in out  # tokenizer.num_replicas: 0, the ingress tokenizes


def test_stop_leaves_no_process(deployment):
    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import session_members
    records = load_processes(ExpPaths(deployment.exp_dir))
    members = session_members(records[0]) if records else []
    assert members  # the server and its Ray processes
    cores = [p for p in members if "flagserve.engine.core.process" in " ".join(p.cmdline())]
    assert len(cores) == (1 if deployment.path == "direct" else 0)  # engine_core: auto / thread
    result = deployment.run_py("stop")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no process left" in result.stdout
    assert all(not session_members(r) for r in records)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{deployment.url}/health", timeout=5)
    assert (deployment.exp_dir / "hooks").read_text().split() == ["start", "stop"]  # once each
    again = deployment.run_py("stop")
    assert again.returncode == 0 and "nothing to stop" in again.stdout
    status = deployment.run_py("status")
    assert status.returncode == 1 and "not running" in status.stdout
