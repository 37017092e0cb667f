"""The printed result table (the layout of vLLM's `bench serve`) and the JSON result."""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from flagserve.bench.metrics import LATENCIES, NAMES, BenchmarkMetrics

WIDTH = 50


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value:>10}"


def table(m: BenchmarkMetrics, title: str = "Serving Benchmark Result",
          prefix_cache: dict | None = None, request_rate: float | None = None,
          max_concurrency: int | None = None) -> str:
    lines = [f"{' ' + title + ' ':=^{WIDTH}}"]
    if request_rate is not None:
        rate = "inf" if math.isinf(request_rate) else float(request_rate)
        lines.append(_row("Request rate (req/s):", rate))
    if max_concurrency:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
        _row("Peak concurrent requests:", m.max_concurrent_requests),
    ]
    if prefix_cache is not None:
        lines.append(_row("Prefix cache hit rate (%):", 100.0 * prefix_cache["hit_rate"]))
    for key in LATENCIES:
        short = key.upper() if key != "e2el" else "E2EL"
        lines.append(f"{' ' + NAMES[key] + ' ':-^{WIDTH}}")
        for stat, value in m.latency_ms[key].items():
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            lines.append(_row(f"{label} {short} (ms):", value))
    for err in m.errors:
        lines.append(f"error: {err}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where and when: enough to compare two results honestly."""
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(),
                            "python": platform.python_version(), "cpus": os.cpu_count(),
                            "platform": platform.platform()}
    with contextlib.suppress(OSError):
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def comparison_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain table: rows of dicts, columns as (key, header)."""
    cells = [[h for _, h in columns]] + [[_fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for n, row in enumerate(cells):
        out.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)
