"""The API edge (issue 12): every field range-checked with a 400 naming it, deploy.limits,
the API key on every route, OpenAI-shaped errors, and an engine no request can kill.

One in-process server for the file: the ingress on its own uvicorn server (h11, as a replica
runs it) over a real engine on a thread, tiny model, no Ray. Fast enough to fuzz.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagserve.config.schema import ApiLimits
from flagserve.entrypoints.openai.api import build_api
from flagserve.entrypoints.openai.ingress import ModelRoute, OpenAIIngress
from flagserve.entrypoints.openai.tokenizer import INLINE_CHARS, PromptTokenizer
from flagserve.serve.engine_clients import LocalEngineSpec
from flagserve.serve.tokenizer_deployment import TokenizerDeployment
from tests.serve.conftest import free_port
from tests.serve.raw_http import exchange, request_head

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_MODEL_LEN = 128
LIMITS = ApiLimits(max_body_bytes=2**20, max_header_bytes=8192, max_prompts=8, max_n=4,
                   max_tokens=16, max_stop=4, max_messages=8)


@dataclass
class Server:
    url: str
    ingress: OpenAIIngress
    app: Any

    def post(self, route: str, body: Any, headers: dict | None = None, **kw: Any) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(self.url + route, data=data, timeout=60, **kw,
                             headers={**AUTH, "Content-Type": "application/json", **(headers or {})})

    def alive(self) -> bool:
        ok = requests.get(self.url + "/health", timeout=10).status_code == 200
        r = self.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        return ok and r.status_code == 200 and self.ingress.engines["llm"].server.async_engine.alive


@pytest.fixture(scope="module")
def server(llama_path):
    port = free_port()
    loop = asyncio.new_event_loop()
    built: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        engine = LocalEngineSpec("llm", MODEL, {"model": llama_path, "dtype": "float32",
                                                "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8},
                                 "thread")
        route = ModelRoute("llm", [MODEL], engine, llama_path, None, [])
        ingress = OpenAIIngress([route], KEY, None, ("127.0.0.1", port), limits=LIMITS, docs=True)
        loop.run_until_complete(ingress.__serve_build_asgi_app__())
        built["ingress"], built["app"] = ingress, build_api(ingress)  # its routes, to list them
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            time.sleep(0.2)
    yield Server(f"http://127.0.0.1:{port}", built["ingress"], built["app"])
    ingress = built["ingress"]
    asyncio.run_coroutine_threadsafe(ingress.http.stop(), loop).result(10)
    ingress.engines["llm"].shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def assert_openai_error(r: requests.Response, status: int, param: str | None = "") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"], error
    if param != "":
        assert error["param"] == param, error
    return error


# The API key and the error shape of every route


def test_every_route_but_health_needs_the_key(server):
    paths = {(m, r.path) for r in server.app.routes for m in getattr(r, "methods", None) or ["GET"]
             if m != "HEAD"}
    assert {("GET", "/docs"), ("GET", "/openapi.json"), ("POST", "/v1/completions")} <= paths
    for method, path in sorted(paths):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = requests.request(method, server.url + path, headers=headers, timeout=10)
            if path == "/health":
                assert r.status_code == 200
            else:
                assert_openai_error(r, 401, None)
    # Paths that do not exist tell nothing without the key either.
    assert_openai_error(requests.get(server.url + "/v2/secret", timeout=10), 401)
    assert requests.get(server.url + "/openapi.json", headers=AUTH, timeout=10).status_code == 200


def test_unknown_routes_and_methods_are_openai_shaped(server):
    error = assert_openai_error(requests.get(server.url + "/v1/nope", headers=AUTH, timeout=10), 404)
    assert "/v1/nope" in error["message"]
    r = requests.get(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


# Field ranges and limits: 400 naming the field, and the engine keeps serving

BAD = [  # route, body, the param named
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e308}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**62}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 5}, "n"),  # LIMITS.max_n
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt"),  # LIMITS.max_prompts
    ("/v1/completions", {"prompt": ["a"] * 200_000}, "prompt"),  # refused before validating each
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 17}, "max_tokens"),  # LIMITS.max_tokens
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2**70]}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 200_000}, "prompt"),  # refused untokenized
    ("/v1/completions", {"prompt": list(range(5)) * 10_000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2**40}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"1000000": 5}}, "logit_bias"),  # past the vocabulary
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000, None),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 400 + b"}", "seed"),
    ("/v1/completions", b"\xff\xfe", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "\udc00": 1}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 17}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 100_000}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 9}, "messages"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_out_of_range_values_are_400_naming_the_field(server, route, body, param):
    start = time.perf_counter()
    assert_openai_error(server.post(route, body), 400, param)
    assert time.perf_counter() - start < 2.0  # nothing long was tokenized


def test_the_engine_survives_them_all(server):
    for route, body, _ in BAD:
        server.post(route, body)
    assert server.alive()


def test_values_at_the_limits_are_served(server):
    r = server.post("/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 16, "seed": 2**63 - 1,
                                        "top_k": 2**31 - 1, "temperature": 3e38, "ignore_eos": True,
                                        "stop": ["x", "y", "z", "w"], "stop_token_ids": [1, 2, 3, 4]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16  # the cap


def test_logit_bias_forces_and_bans_tokens(server, llama_path):
    """+100 on a token makes greedy decoding emit it every step, on both routes (the
    engine-level behaviour: tests/test_sampling.py)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama_path)
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False}
    plain = server.post("/v1/completions", body).json()["choices"][0]["text"]
    forced = tok.encode("x", add_special_tokens=False)[-1]
    r = server.post("/v1/completions", {**body, "logit_bias": {str(forced): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 6)
    assert plain != tok.decode([forced] * 6)
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                             "max_completion_tokens": 6, "temperature": 0.8,
                                             "seed": 3, "logit_bias": {str(forced): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tok.decode([forced] * 6)


# Body and header size

def head(*lines: str) -> bytes:
    return request_head("/v1/completions", KEY, *lines)


def test_a_declared_huge_body_is_refused_before_it_is_read(server):
    start = time.perf_counter()
    answer, _ = exchange(server.url, head(f"Content-Length: {50 * 2**20}"))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.perf_counter() - start < 1.0
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 413 and "max_body_bytes" in body["error"]["message"]


def test_a_chunked_huge_body_is_cut_at_the_limit(server):
    rss = psutil.Process().memory_info().rss
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"  # 64 KiB of JSON whitespace per chunk
    start = time.perf_counter()
    answer, sent = exchange(server.url, head("Transfer-Encoding: chunked"), [chunk] * 800)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 4 * LIMITS.max_body_bytes  # it stopped reading near the limit, not at 50 MiB
    assert time.perf_counter() - start < 5.0
    assert psutil.Process().memory_info().rss - rss < 32 * 2**20
    assert server.alive()


def test_oversized_headers_are_refused(server):
    answer, _ = exchange(server.url, head("Content-Length: 2", "X-Big: " + "a" * 20_000))
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]  # whole in one read: the app measures
    assert b"max_header_bytes" in answer
    # One header growing without end: the HTTP server stops buffering it near the limit.
    answer, sent = exchange(server.url, head()[:-4] + b"\r\nX-Big: ", [b"a" * 4096] * 2048, pause=0.001)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert sent < 2**20
    assert server.alive()


def raw(server: Server, text: str) -> bytes:
    answer, _ = exchange(server.url, text.replace("\n", "\r\n").encode())
    return answer


def test_absolute_form_targets_are_their_paths(server):
    """RFC 9112 has servers accept `GET http://host/path`: h11 passed the whole URL on as
    the path, so /health needed the key and /v1/models was no route."""
    assert raw(server, "GET http://x/health HTTP/1.1\nHost: x\nConnection: close\n\n") \
        .startswith(b"HTTP/1.1 200")
    answer = raw(server, f"GET http://x/v1/models HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY}"
                         "\nConnection: close\n\n")
    assert answer.startswith(b"HTTP/1.1 200") and b'"id":"tiny"' in answer, answer[:300]
    assert raw(server, "GET http://x/v1/models HTTP/1.1\nHost: x\nConnection: close\n\n") \
        .startswith(b"HTTP/1.1 401")


def test_the_bearer_scheme_is_case_free_the_key_is_not(server):
    for scheme in ("bearer", "BEARER"):
        r = requests.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"},
                         timeout=10)
        assert r.status_code == 200, r.text
    r = requests.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY.upper()}"},
                     timeout=10)
    assert_openai_error(r, 401, None)


def test_a_compressed_body_is_refused_by_name(server):
    r = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2},
                    headers={"Content-Encoding": "gzip"})
    error = assert_openai_error(r, 415, None)
    assert "Content-Encoding 'gzip'" in error["message"]


def test_a_client_leaving_mid_body_is_no_server_error(server, caplog):
    """It logged two ERROR tracebacks (the app's and uvicorn's) and answered a 500 nobody read."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head("Content-Length: 100") + b'{"prompt": ')
        time.sleep(0.2)
    time.sleep(0.5)  # the replica notices the disconnect
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert server.alive()


# Tokenization off the event loop

def test_large_inputs_are_tokenized_on_a_thread(llama_path):
    tok = PromptTokenizer(llama_path)
    threads = []
    encode = tok.tokenizer.encode
    tok.tokenizer.encode = lambda *a, **kw: threads.append(threading.current_thread().name) or encode(
        *a, **kw)

    async def main() -> None:
        await tok.encode_prompts_async(["short"], 100)
        await tok.encode_prompts_async(["x " * INLINE_CHARS], None)
        await tok.encode_chat_async([{"role": "user", "content": "y " * INLINE_CHARS}])

    asyncio.run(main())
    assert threads[0] == threading.main_thread().name
    assert all(name.startswith("tokenize") for name in threads[1:]) and len(threads) == 3


def test_the_tokenizer_deployment_takes_the_same_bound(llama_path):
    """tokenizer.num_replicas >= 1: the ingress calls these with the same arguments."""
    dep = TokenizerDeployment(llama_path)
    with pytest.raises(ValueError, match="characters"):
        asyncio.run(dep.encode_prompts(["x " * 10_000], MAX_MODEL_LEN - 1))
    messages = [{"role": "user", "content": "hi"}]
    assert asyncio.run(dep.encode_chat(messages, max_tokens=MAX_MODEL_LEN - 1))


def test_the_length_precheck_never_refuses_what_fits(llama_path):
    tok = PromptTokenizer(llama_path)
    for text in ("a" * 3000, "😀" * 500, "\n" * 4000, " " * 5000, "ab12 " * 900):
        n = len(tok.tokenizer.encode(text))
        tok.check_length(text, n)  # a bound, not an estimate: exactly n tokens always passes


# Fuzz: 4xx, never 5xx, and a healthy server after

def _weird() -> st.SearchStrategy:
    ints = st.one_of(st.integers(-3, 20), st.integers(), st.sampled_from(
        [2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30]))
    floats = st.one_of(st.floats(), st.sampled_from([1e308, -0.0, 5e-324, 3e38, 3.5e38, 0.5, 2.0]))
    texts = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "", "\x00"]))
    leaf = st.one_of(st.none(), st.booleans(), ints, floats, texts)
    return st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                     st.dictionaries(texts, kids, max_size=2)),
                        max_leaves=6)


WEIRD = _weird()
FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
          "max_tokens", "logprobs", "stream", "stream_options", "skip_special_tokens", "model",
          "include_stop_str_in_output", "best_of", "echo", "user", "logit_bias", "prompt_logprobs"]
CHAT_FIELDS = ["max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools", "tool_choice",
               "parallel_tool_calls",
               "chat_template_kwargs"]
PROMPTS = st.one_of(st.just("Hello"), st.lists(st.integers(-2, 2000), max_size=4),
                    st.lists(st.sampled_from(["a", "b c", ""]), max_size=3), WEIRD)
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), WEIRD),
     "content": st.one_of(st.just("hi"), WEIRD)}), max_size=3), WEIRD)


def _body(fields: list[str], base: dict) -> st.SearchStrategy:
    def pick(key: str) -> st.SearchStrategy:
        if key in ("max_tokens", "max_completion_tokens"):
            return st.one_of(st.integers(1, 4), WEIRD)  # short generations keep the fuzz quick
        if key == "model":
            return st.one_of(st.just(MODEL), WEIRD)
        return WEIRD
    return st.fixed_dictionaries(base, optional={k: pick(k) for k in fields})


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), _body(FIELDS, {"prompt": PROMPTS})),
    st.tuples(st.just("/v1/chat/completions"), _body(FIELDS + CHAT_FIELDS, {"messages": MESSAGES})),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=40)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(REQUESTS)
def test_fuzzed_requests_get_4xx_never_5xx(server, request_):
    route, body = request_
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = server.post(route, data)
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert '"code": 5' not in r.text, r.text  # an in-band error after the 200
        return
    assert_openai_error(r, r.status_code)
    assert 400 <= r.status_code < 500, (body, r.text)


def test_the_server_is_healthy_after_the_fuzz(server):
    assert server.alive()
