"""Counters from a server's Prometheus /metrics (vLLM's names), summed over replicas."""
from __future__ import annotations

import re
import time

from flagserve.cluster.http import get

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
GENERATED = "vllm:generation_tokens_total"
COUNTERS = (QUERIES, HITS, GENERATED)
_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", re.M)


def parse(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        if name in names:
            out[name] = out.get(name, 0.0) + float(value)
    return out


def scrape(root: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, float] | None:
    """The counters, or None when the server has no readable /metrics."""
    try:
        return parse(get(f"{root}/metrics", api_key, timeout).decode(errors="replace"))
    except (OSError, ValueError):
        return None


def scrape_after(root: str, api_key: str | None, before: dict[str, float] | None,
                 generated: int, wait_s: float = 5.0) -> dict[str, float] | None:
    """Scrape until the generation counter has caught up with the run (servers that publish
    metrics periodically, as FlagServe's engine replicas do every 0.5 s), at most wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        after = scrape(root, api_key)
        if after is None or before is None:
            return after
        if after.get(GENERATED, 0) - before.get(GENERATED, 0) >= generated or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def prefix_cache_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """{queries, hits, hit_rate} over the run, or None without the counters."""
    if before is None or after is None or QUERIES not in after:
        return None  # no /metrics, or not vLLM's counters
    queries = after.get(QUERIES, 0) - before.get(QUERIES, 0)
    hits = after.get(HITS, 0) - before.get(HITS, 0)
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries else 0.0}
