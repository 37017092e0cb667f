"""Send the workload to an OpenAI-compatible endpoint and time every streamed chunk.

One aiohttp session; each request waits for its arrival time, then for a concurrency slot,
then streams (SSE) from /v1/completions or /v1/chat/completions with
stream_options.include_usage, so the token counts are the server's own. A "chunk" is one
read from the socket that carries text: SSE events read together arrived together.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from flagserve.bench.datasets import SampleRequest, warmup_samples
from flagserve.bench.metrics import RequestResult
from flagserve.config.schema import BenchEndpoint

ENDPOINTS: dict[BenchEndpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TIMEOUT_S = 6 * 3600


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    api_key: str | None = None
    endpoint: BenchEndpoint = "completions"
    ignore_eos: bool = True  # generate exactly output_len tokens (vLLM's extra field)
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    @property
    def url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def body(self, sample: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "temperature": self.temperature,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = sample.messages
        else:
            body["prompt"] = sample.text
        if sample.output_len is not None:
            body["max_tokens"] = sample.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        if sample.schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": sample.schema}}
        body.update(self.extra_body or {})
        return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _take_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    """The server's own token counts (stream_options.include_usage)."""
    result.output_len = usage.get("completion_tokens") or 0
    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


async def send_one(session: aiohttp.ClientSession, target: Target, sample: SampleRequest,
                   t0: float) -> RequestResult:
    """Stream one request; times are perf_counter seconds relative to t0 (the run's start)."""
    result = RequestResult(success=False, prompt_len=sample.prompt_len)
    chat = target.endpoint == "chat"
    start = time.perf_counter()
    result.start = start - t0
    last = start
    chunks = 0
    try:
        async with session.post(target.url, json=target.body(sample), headers=target.headers()) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            # Events that arrive in the same read reach the client at the same instant: they
            # count as one chunk (one ITL gap), never as a burst of ~0 ms gaps.
            pending = b""
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + data).split(b"\n")
                text = False
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        result.error = str(event["error"].get("message", event["error"]))[:200]
                        return result
                    text = text or any(_chunk_text(c, chat) for c in event.get("choices") or ())
                    if event.get("usage"):
                        _take_usage(result, event["usage"])
                if text:
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    result.chunk_times.append(now - t0)
                    last = now
                    chunks += 1
                if done:
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"[:200]
        return result
    if chunks == 0:
        result.error = "no output chunk"
        return result
    result.latency = last - start
    result.output_len = result.output_len or chunks  # a server without usage: chunks ~ tokens
    result.success = True
    return result


async def run_requests(target: Target, samples: list[SampleRequest], offsets: list[float],
                       max_concurrency: int | None = None, progress: bool = True
                       ) -> tuple[list[RequestResult], float]:
    """Send samples[i] at offsets[i] seconds (waiting for a slot if max_concurrency is set).

    Returns the results in sample order and the duration (first send to last completion)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(samples), desc="requests", unit="req", disable=not progress, smoothing=0)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     read_bufsize=2**20) as session:
        t0 = time.perf_counter()

        async def task(sample: SampleRequest, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                out = await send_one(session, target, sample, t0)
            else:
                async with slots:
                    out = await send_one(session, target, sample, t0)
            bar.update(1)
            return out

        results = await asyncio.gather(*(task(s, o) for s, o in zip(samples, offsets)))
        duration = time.perf_counter() - t0
    bar.close()
    first = min((r.start for r in results), default=0.0)
    return list(results), duration - first


def warm_up(target: Target, samples: list[SampleRequest], warmup: int = 1) -> int:
    """Send short warm-up requests (not counted; datasets.warmup_samples: the first `warmup`
    and one per schema, reversed); raises if the endpoint fails them. Returns the tokens they
    generated."""
    warm = warmup_samples(samples, warmup)
    if not warm:
        return 0
    results, _ = asyncio.run(run_requests(target, warm, [0.0] * len(warm), progress=False))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"warm-up request to {target.url} failed: {failed[0]}")
    return sum(r.output_len for r in results)


def bench_http(target: Target, samples: list[SampleRequest], offsets: list[float],
               max_concurrency: int | None = None, progress: bool = True
               ) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_requests(target, samples, offsets, max_concurrency, progress))
