"""Metric definitions as vLLM's `bench serve`: TTFT, TPOT, ITL, E2E, percentiles, throughput."""
from __future__ import annotations

import numpy as np
import pytest

from flagserve.bench.metrics import RequestResult, compute, max_concurrency, stats, throughput_over_time
from flagserve.bench.prom import parse, prefix_cache_delta


def result(start, ttft, gaps, output_len=None, prompt_len=10):
    """A request sent at `start`, first chunk after `ttft`, then chunks `gaps` apart."""
    times = np.cumsum([start + ttft, *gaps]).tolist()
    return RequestResult(True, prompt_len, output_len if output_len is not None else len(gaps) + 1,
                         start, ttft, ttft + sum(gaps), list(gaps), times)


def test_percentiles_are_numpy_linear_in_ms():
    s = stats([0.001, 0.002, 0.003, 0.004], percentiles=(50, 90, 99))
    assert s["mean"] == pytest.approx(2.5) and s["median"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97)
    assert s["std"] == pytest.approx(np.std([1, 2, 3, 4]))


def test_tpot_excludes_first_token_and_itl_is_every_gap():
    r = result(0.0, 0.100, [0.010, 0.020, 0.030])  # 4 tokens
    assert r.latency == pytest.approx(0.160)
    assert r.tpot == pytest.approx((0.160 - 0.100) / 3)
    m = compute([r], duration_s=1.0)
    assert m.latency_ms["ttft"]["median"] == pytest.approx(100)
    assert m.latency_ms["itl"]["median"] == pytest.approx(20)  # the gaps, not their mean per request
    assert m.latency_ms["e2el"]["mean"] == pytest.approx(160)


def test_tpot_counts_tokens_not_chunks():
    # a server merged 6 tokens into 3 chunks: ITL sees 2 gaps, TPOT divides by 5 tokens
    r = result(0.0, 0.05, [0.02, 0.03], output_len=6)
    assert r.tpot == pytest.approx(0.05 / 5)
    assert compute([r], 1.0).latency_ms["itl"]["mean"] == pytest.approx(25)


def test_single_token_requests_have_no_tpot():
    r = result(0.0, 0.05, [], output_len=1)
    assert r.tpot is None
    assert compute([r], 1.0).latency_ms["tpot"]["mean"] == 0.0


def test_throughputs_and_failures():
    ok = [result(0.0, 0.1, [0.1] * 9, prompt_len=20), result(0.5, 0.1, [0.1] * 4, prompt_len=30)]
    failed = RequestResult(False, 50, error="HTTP 500: boom")
    m = compute([*ok, failed], duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 50 and m.total_output_tokens == 15  # failed ones don't count
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx(32.5)
    assert m.errors == ["HTTP 500: boom"]


def test_max_concurrency_and_throughput_over_time():
    rs = [result(0.0, 0.1, [0.1] * 9), result(0.5, 0.1, [0.1] * 9), result(2.0, 0.1, [0.1] * 4)]
    assert max_concurrency(rs) == 2
    t, tps, in_flight = throughput_over_time(rs, duration_s=2.5, bins=5)
    assert tps.sum() * 0.5 == pytest.approx(25)  # every output token lands in one bin
    assert in_flight.tolist() == [1, 2, 1, 0, 1]


def test_prometheus_counters_summed_over_replicas():
    text = """# HELP vllm:prefix_cache_queries_total x
vllm:prefix_cache_queries_total{engine="a",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="b",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="a",model_name="m"} 30.0
vllm:generation_tokens_total{engine="a",model_name="m"} 7.0
"""
    after = parse(text)
    assert after["vllm:prefix_cache_queries_total"] == 150
    delta = prefix_cache_delta({"vllm:prefix_cache_queries_total": 50}, after)
    assert delta == {"queries": 100, "hits": 30, "hit_rate": 0.3}
    assert prefix_cache_delta(None, after) is None and prefix_cache_delta({}, {}) is None
