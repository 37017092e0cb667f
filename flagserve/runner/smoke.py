"""action=test: run, send a real completion and chat, check the answers, stop."""
from __future__ import annotations

import json
import sys

from flagserve.cluster import http
from flagserve.config.schema import Config
from flagserve.config.topology import served_names
from flagserve.runner.deployment import Deployment


def smoke_test(deployment: Deployment) -> int:
    """Test the running deployment (it stays running), or run one for the test and stop it."""
    started = False
    if deployment.is_running():
        print("testing the deployment that is already running (it stays running)")
    else:
        if deployment.run(hints=False) != 0:
            return 1
        started = True
        print("started for the test; it is stopped when the test ends")
    try:
        problems = check(deployment.config, deployment.endpoint)
    finally:
        if started:
            deployment.stop()
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    print("test passed" if not problems else "test FAILED")
    return 0 if not problems else 1


def check(config: Config, url: str) -> list[str]:
    key = config.api_key
    problems = []
    for module_id, module in config.llms.items():
        model = served_names(module_id, module)[0]
        for route, body in (
            ("completions", {"model": model, "prompt": "The capital of France is",
                             "max_tokens": 8, "temperature": 0}),
            ("chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Say hello."}]}),
        ):
            problems += _check_one(f"{url}/v1/{route}", body, key, model)
    return problems


def _check_one(url: str, body: dict, key: str | None, model: str) -> list[str]:
    try:
        code, raw = http.request(url, body, key, timeout=120)
    except OSError as err:
        return [f"{url}: {err}"]
    if code != 200:
        return [f"{url}: HTTP {code}: {raw[:300]!r}"]
    reply = json.loads(raw)
    choice = reply["choices"][0]
    text = choice.get("text") if "text" in choice else choice["message"]["content"]
    usage = reply.get("usage", {})
    print(f"{model} {url.rsplit('/v1/', 1)[1]}: {text!r} ({choice['finish_reason']}, "
          f"{usage.get('completion_tokens')} tokens)")
    problems = []
    if not isinstance(text, str):
        problems.append(f"{url}: no text in {reply}")
    if choice["finish_reason"] not in ("stop", "length"):
        problems.append(f"{url}: finish_reason {choice['finish_reason']!r}")
    if not 1 <= usage.get("completion_tokens", 0) <= body["max_tokens"]:
        problems.append(f"{url}: usage {usage} does not fit max_tokens={body['max_tokens']}")
    if choice["finish_reason"] == "length" and usage.get("completion_tokens") != body["max_tokens"]:
        problems.append(f"{url}: finished by length after {usage.get('completion_tokens')} tokens")
    return problems
