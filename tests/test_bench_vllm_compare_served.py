"""compare_vllm_served's table: FlagServe's ratios against vLLM per rate (no servers run)."""
import math

from flagserve.bench.metrics import BenchmarkMetrics
from flagserve.bench.vllm_compare_served import rate_name, run_names, table


def metrics(tok_s: float, ttft: float, itl: float, ttft_p99: float) -> BenchmarkMetrics:
    lat = {"ttft": {"median": ttft, "p99": ttft_p99}, "itl": {"median": itl, "p99": itl}}
    return BenchmarkMetrics(100, 0, 10.0, 12800, 6400, 10.0, tok_s, 0.0, 100, lat)


def test_ratio_rows_divide_flagserve_by_vllm():
    runs = {"flagserve": {rate_name(4.0): metrics(120, 300, 50, 900)},
            "vllm": {rate_name(4.0): metrics(100, 600, 25, 300)}}
    rows = table(runs).splitlines()
    assert rows[-1] == "| 4 req/s | FlagServe / vLLM | 1.20x | 0.50x | 2.00x | 3.00x |"
    assert len(rows) == 5


def test_one_engine_has_no_ratio_rows():
    runs = {"flagserve": {rate_name(math.inf): metrics(120, 300, 50, 900)}}
    rows = table(runs).splitlines()
    assert rows[2:] == ["| all at once | flagserve | 120.0 | 300 | 50 | 900 |"]


def test_repeated_rates_get_a_row_each():
    assert run_names([4.0, 4.0, math.inf, 4.0]) == ["4 req/s #1", "4 req/s #2", "all at once",
                                                    "4 req/s #3"]
    assert run_names([1.0, math.inf]) == ["1 req/s", "all at once"]
