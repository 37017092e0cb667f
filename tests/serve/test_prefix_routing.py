"""Prefix-aware routing across 2 engine replicas (issue 15): requests sharing a long prefix
land on the replica that holds it, so the prefix-cache hit rate read from /metrics is what
every repeat hitting gives (twice round robin's on the same requests), and the router's
decisions are on /metrics too."""
from __future__ import annotations

import re
import time

import requests

from tests.serve.conftest import free_port, kill_recorded, run_py, tiny_serve_args

PREFIXES = 12  # distinct shared prefixes: 12 all on one replica would be a 1-in-2048 chance
REPEATS = 3  # requests per prefix, sent one after another (loads stay equal)
PREFIX_TOKENS = 256  # 16 blocks of 16 tokens
SUFFIX_TOKENS = 16


def prompts() -> list[list[int]]:
    out = []
    for p in range(PREFIXES):
        prefix = [(p * 97 + i * 13) % 1400 + 100 for i in range(PREFIX_TOKENS)]
        out += [prefix + [(r * 31 + i + p) % 90 + 5 for i in range(SUFFIX_TOKENS)]
                for r in range(REPEATS)]
    return out


def scrape(url: str, name: str) -> dict[tuple[str, ...], float]:
    """Samples of metric `name`: label values (in the exposition's order) -> value."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {tuple(re.findall(r'="([^"]*)"', labels)): float(value)
            for labels, value in re.findall(rf'^{re.escape(name)}\{{([^}}]*)\}} (\S+)$', text, re.M)}


def counters(url: str) -> dict[str, dict[tuple[str, ...], float]]:
    names = ("vllm:request_success_total", "flagserve:router_decisions_total",
             "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return {name: scrape(url, name) for name in names}


def settled(url: str, requests_done: int) -> dict[str, dict[tuple[str, ...], float]]:
    """The counters once the engines' and routers' pushes (every 0.5 s) cover
    `requests_done` requests."""
    for _ in range(60):
        c = counters(url)
        if (sum(c["vllm:request_success_total"].values()) == requests_done
                and sum(c["flagserve:router_decisions_total"].values()) == requests_done):
            return c
        time.sleep(0.5)
    # stale counts would pass for a routing failure (an engine missing from the difference)
    raise AssertionError(f"/metrics does not cover {requests_done} requests after 30 s: {c}")


def since(after: dict, before: dict) -> dict[str, dict[tuple[str, ...], float]]:
    return {name: {k: v - before[name].get(k, 0.0) for k, v in samples.items()
                   if v != before[name].get(k, 0.0)} for name, samples in after.items()}


def warm_up(session: requests.Session, url: str) -> int:
    """Requests of their own (one full block each) until both engines served one: a router may
    not know the second replica for its first few requests after start-up."""
    sent = 0
    for _ in range(10):
        for _ in range(2):
            r = session.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "max_tokens": 1,
                "prompt": [5 + (sent * 7 + i) % 90 for i in range(20)]})
            assert r.status_code == 200, r.text
            sent += 1
        served = settled(url, sent)["vllm:request_success_total"]
        if len({k[0] for k, n in served.items() if n > 0}) == 2:
            return sent
    raise AssertionError(f"after {sent} requests one engine has served none: {served}")


def serve_and_measure(tmp_path, strategy: str) -> tuple[float, dict, dict]:
    """Start 2 replicas routed by `strategy`, warm both up, send the prompts, return (for the
    prompts alone) the prefix-cache hit rate over both engines, requests finished per engine
    and the router's decisions."""
    port = free_port()
    args = tiny_serve_args(tmp_path / strategy, port, "serve.llm.resources.num_replicas=2",
                           f"serve.llm.router.strategy={strategy}",
                           "serve.llm.engine_args.max_model_len=512",
                           "serve.llm.engine_args.cpu_kv_cache_space_gib=0.05")
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        url = f"http://127.0.0.1:{port}"
        with requests.Session() as s:
            warm = warm_up(s, url)
            before = settled(url, warm)
            for prompt in prompts():
                r = s.post(f"{url}/v1/completions", timeout=60,
                           json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
        c = since(settled(url, warm + PREFIXES * REPEATS), before)
        done = {k[0]: v for k, v in c["vllm:request_success_total"].items() if k[1] == "length"}
        hits = sum(c["vllm:prefix_cache_hits_total"].values())
        queries = sum(c["vllm:prefix_cache_queries_total"].values())
        return hits / queries, done, c["flagserve:router_decisions_total"]
    finally:
        stop = run_py(*args, "action=stop", timeout=120)
        if stop.returncode != 0:
            kill_recorded(tmp_path / strategy)


def test_prefix_aware_routing_sends_repeats_to_the_holder(tmp_path):
    total = PREFIXES * REPEATS
    rate, done, decisions = serve_and_measure(tmp_path, "prefix_aware")
    # Both engines took requests (prefix_aware did not just pick one).
    assert len(done) == 2 and min(done.values()) > 0 and sum(done.values()) == total, \
        (done, decisions)
    # Labels in name order: engine, model_name, outcome, strategy. Each prefix's first request
    # has no holder (balance); every later one goes where it went (affinity).
    by_outcome: dict[str, float] = {}
    for (_, model, outcome, strategy), n in decisions.items():
        assert (model, strategy) == ("tiny-llama", "prefix_aware")
        by_outcome[outcome] = by_outcome.get(outcome, 0) + n
    assert by_outcome == {"balance": PREFIXES, "affinity": total - PREFIXES}, decisions
    # Every repeat of a prefix hits on its replica: 24 of 36 prompts reuse 256 of 272 tokens
    # (0.63). Round robin (tests/api/test_routing.py) would send each prefix's 3 requests
    # to alternate replicas and compute it on both: 12 hits of 36 (0.31).
    assert rate > 0.55, rate
