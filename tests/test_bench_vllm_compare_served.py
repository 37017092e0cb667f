"""compare_vllm_served without servers: FlagServe's ratios against vLLM per rate, the order
the engines take each run, and the idle server paused."""
import math
import subprocess
import sys

import psutil
import pytest

from flagserve.bench.metrics import BenchmarkMetrics
from flagserve.bench.vllm_compare_served import (
    Server,
    alternate,
    paused,
    rate_name,
    run_names,
    table,
)


def metrics(tok_s: float, ttft: float, itl: float, ttft_p99: float) -> BenchmarkMetrics:
    lat = {"ttft": {"median": ttft, "p99": ttft_p99}, "itl": {"median": itl, "p99": itl}}
    return BenchmarkMetrics(100, 0, 10.0, 12800, 6400, 10.0, tok_s, 0.0, 100, lat)


def test_ratio_rows_divide_flagserve_by_vllm():
    runs = {"flagserve": {rate_name(4.0): metrics(120, 300, 50, 900)},
            "vllm": {rate_name(4.0): metrics(100, 600, 25, 300)}}
    rows = table(runs).splitlines()
    assert rows[-1] == "| 4 req/s | FlagServe / vLLM | 1.20x | 0.50x | 2.00x | 3.00x | - |"
    assert len(rows) == 5


def test_the_arrivals_bound_what_any_server_reaches():
    """The last request sent at 8 s: no server ends before, so 6,400 tokens make at most 800
    tok/s, and against vLLM's 10 s run at most 1.25x."""
    runs = {engine: {rate_name(4.0): metrics(tok_s, 300, 50, 900)}
            for engine, tok_s in (("flagserve", 700), ("vllm", 640))}
    rows = table(runs, {rate_name(4.0): 8.0}).splitlines()
    assert [row.split(" | ")[-1] for row in rows[2:]] == ["800.0 |", "800.0 |", "1.25x |"]
    assert rows[-1].startswith("| 4 req/s | FlagServe / vLLM | 1.09x |")


def test_one_engine_has_no_ratio_rows():
    runs = {"flagserve": {rate_name(math.inf): metrics(120, 300, 50, 900)}}
    rows = table(runs, {rate_name(math.inf): 0.0}).splitlines()
    assert rows[2:] == ["| all at once | flagserve | 120.0 | 300 | 50 | 900 | - |"]


def test_repeated_rates_get_a_row_each():
    assert run_names([4.0, 4.0, math.inf, 4.0]) == ["4 req/s #1", "4 req/s #2", "all at once",
                                                    "4 req/s #3"]
    assert run_names([1.0, math.inf]) == ["1 req/s", "all at once"]


def test_the_first_engine_alternates_from_run_to_run():
    engines = ["flagserve", "vllm"]
    assert [alternate(engines, run) for run in range(3)] == [engines, engines[::-1], engines]
    assert alternate(["flagserve"], 1) == ["flagserve"]


def test_paused_stops_the_other_servers_processes_and_continues_them_even_on_error():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        proc = psutil.Process(child.pid)
        server = Server("http://127.0.0.1:1", lambda: [proc])
        with pytest.raises(RuntimeError), paused([server]):
            assert proc.status() == psutil.STATUS_STOPPED
            raise RuntimeError("a failed run")
        assert proc.status() != psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()
