"""Per-request timings -> the numbers vLLM's `bench serve` reports, with its definitions.

    TTFT  time from sending the request to the first chunk carrying output text
    ITL   every gap between consecutive chunks of one request (a chunk may hold several
          tokens when the server merges them; vLLM counts each chunk as one gap too). Over
          HTTP a chunk is one socket read carrying text, so SSE events that arrive together
          make one gap, not a burst of ~0 ms gaps (vLLM's client would count those)
    TPOT  per request: (E2E - TTFT) / (output tokens - 1), for requests with > 1 token
    E2E   time from sending the request to its last chunk
Throughputs divide by the run's duration (first send to last completion). Percentiles are
numpy's (linear interpolation), reported in milliseconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (90, 99)  # the median is always reported
LATENCIES = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
         "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_len: int = 0  # generated tokens (the server's usage when it reports it)
    start: float = 0.0  # send time, seconds since the run started
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # end to end, seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    chunk_times: list[float] = field(default_factory=list)  # run-relative time of each chunk
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, if reported
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def stats(values_s: list[float], percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """mean, median, std and percentiles of values given in seconds, returned in ms."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in percentiles:
        out[f"p{p}"] = float(np.percentile(ms, p))
    return out


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_concurrent_requests: int
    latency_ms: dict[str, dict[str, float]]  # ttft|tpot|itl|e2el -> mean, median, std, pNN
    errors: list[str] = field(default_factory=list)  # the first few, for the report

    def to_dict(self) -> dict:
        return asdict(self)


def max_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in results if r.success]
                    + [(r.start + r.latency, -1) for r in results if r.success])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def compute(results: list[RequestResult], duration_s: float,
            percentiles: tuple[int, ...] = PERCENTILES) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    duration = max(duration_s, 1e-9)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(ok) / duration, output_throughput=outputs / duration,
        total_token_throughput=(inputs + outputs) / duration,
        max_concurrent_requests=max_concurrency(results),
        latency_ms={k: stats(v, percentiles) for k, v in values.items()},
        errors=sorted({r.error for r in results if not r.success})[:5])


def throughput_over_time(results: list[RequestResult], duration_s: float,
                         bins: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin centres s, output tok/s per bin, requests in flight at each centre).

    A request's tokens are spread evenly over its chunks (chunks may hold several tokens)."""
    edges = np.linspace(0.0, max(duration_s, 1e-6), bins + 1)
    tokens = np.zeros(bins)
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        idx = np.clip(np.searchsorted(edges, r.chunk_times, side="right") - 1, 0, bins - 1)
        np.add.at(tokens, idx, per_chunk)
    width = edges[1] - edges[0]
    centres = (edges[:-1] + edges[1:]) / 2
    in_flight = np.array([sum(1 for r in results if r.success and r.start <= t < r.start + r.latency)
                          for t in centres])
    return centres, tokens / width, in_flight
