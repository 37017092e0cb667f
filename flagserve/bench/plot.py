"""PNG figures: one run (latency distributions, throughput over time), the baselines, a sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flagserve.bench.metrics import BenchmarkMetrics, RequestResult, throughput_over_time  # noqa: E402

COLORS = {"http": "#1f77b4", "engine": "#ff7f0e", "on": "#2ca02c", "off": "#d62728", "hf": "#7f7f7f"}


def _cdf(ax: Any, values_ms: list[float], label: str, color: str | None = None) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label, color=color, lw=1.6)


def plot_run(path: str | Path, title: str, runs: dict[str, tuple[list[RequestResult], float]]) -> Path:
    """runs: label -> (results, duration). One line per run in each panel (e.g. HTTP vs engine)."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_ttft, ax_itl), (ax_e2e, ax_tp) = axes
    colors = [COLORS["http"], COLORS["engine"], COLORS["on"], COLORS["off"]]
    for (label, (results, duration)), color in zip(runs.items(), colors):
        ok = [r for r in results if r.success]
        _cdf(ax_ttft, [r.ttft * 1e3 for r in ok], label, color)
        _cdf(ax_itl, [g * 1e3 for r in ok for g in r.itl], label, color)
        _cdf(ax_e2e, [r.latency * 1e3 for r in ok], label, color)
        t, tps, in_flight = throughput_over_time(results, duration)
        ax_tp.plot(t, tps, label=f"{label}: output tok/s", color=color, lw=1.6)
        ax_tp.plot(t, in_flight * (tps.max() / max(in_flight.max(), 1) if len(tps) else 1),
                   color=color, lw=0.8, ls=":", label=f"{label}: requests in flight (scaled)")
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "ITL"), (ax_e2e, "E2E latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
        ax.set_title(f"{name} distribution (CDF)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    positive = [g for _, (rs, _) in runs.items() for r in rs if r.success for g in r.itl if g > 0]
    if positive and max(positive) / min(positive) > 50:
        ax_itl.set_xscale("log")
    ax_tp.set_xlabel("time since start (s)")
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("throughput over time")
    ax_tp.grid(alpha=0.3)
    ax_tp.legend(fontsize=8)
    return _save(fig, title, path)


def _save(fig: Any, title: str, path: str | Path) -> Path:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax: Any, labels: list[str], values: list[float], colors: list[str], unit: str,
          errors: list[float] | None = None) -> None:
    bars = ax.bar(labels, values, color=colors, yerr=errors, capsize=4 if errors else 0)
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.2f} {unit}" if value < 100 else f"{value:.0f} {unit}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _baseline_panels(baselines: dict[str, Any]) -> list[tuple[str, list[str], list[float], list[str], str]]:
    """(title, labels, values, colors, unit) of one bar chart per measured comparison."""
    panels = []
    if "serving_path" in baselines:
        sp = baselines["serving_path"]
        for metric, title in (("ttft", f"median TTFT: +{sp['ttft_overhead_ms']:.2f} ms via HTTP"),
                              ("itl", f"median ITL: {sp['itl_overhead_pct']:+.1f}% via HTTP")):
            panels.append((title, ["HTTP", "in-process engine"],
                           [sp["http"][metric]["median"], sp["engine"][metric]["median"]],
                           [COLORS["http"], COLORS["engine"]], "ms"))
    if "prefix_caching" in baselines:
        pc = baselines["prefix_caching"]
        panels.append((f"shared prefix, median TTFT: off/on = {pc['ttft_ratio']:.2f}x",
                       ["caching on", "caching off"],
                       [pc["on"]["ttft"]["median"], pc["off"]["ttft"]["median"]],
                       [COLORS["on"], COLORS["off"]], "ms"))
    if "continuous_batching" in baselines:
        cb = baselines["continuous_batching"]
        labels, values, colors = ["FlagServe engine"], [cb["flagserve_output_tps"]], [COLORS["engine"]]
        if cb.get("hf_output_tps"):
            labels.append("HF generate")
            values.append(cb["hf_output_tps"])
            colors.append(COLORS["hf"])
        ratio = f": {cb['ratio']:.2f}x" if cb.get("ratio") else ""
        panels.append((f"offline output throughput{ratio}", labels, values, colors, "tok/s"))
    return panels


def plot_baselines(path: str | Path, title: str, baselines: dict[str, Any]) -> Path | None:
    """Bars for each baseline that ran: serving path cost, prefix caching, continuous batching."""
    panels = _baseline_panels(baselines)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (panel_title, labels, values, colors, unit) in zip(np.atleast_1d(axes), panels):
        _bars(ax, labels, values, colors, unit)
        ax.set_title(panel_title)
        ax.set_ylabel("output tokens/s" if unit == "tok/s" else unit)
    return _save(fig, title, path)


def plot_sweep(path: str | Path, title: str, labels: list[str],
               metrics: list[BenchmarkMetrics]) -> Path:
    """Throughput and median/p90 latencies per sweep point."""
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(labels))
    ax_tp.bar(x, [m.output_throughput for m in metrics], color=COLORS["http"])
    ax_tp.set_xticks(x, labels, rotation=15, fontsize=8)
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_title("output throughput")
    ax_tp.grid(axis="y", alpha=0.3)
    for key, color in (("ttft", COLORS["http"]), ("tpot", COLORS["engine"]), ("itl", COLORS["on"])):
        ax_lat.plot(x, [m.latency_ms[key]["median"] for m in metrics], "o-", color=color,
                    label=f"median {key.upper()}")
        ax_lat.plot(x, [m.latency_ms[key]["p90"] for m in metrics], "o--", color=color, alpha=0.5,
                    label=f"p90 {key.upper()}")
    ax_lat.set_xticks(x, labels, rotation=15, fontsize=8)
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    ax_lat.set_title("latency")
    ax_lat.grid(alpha=0.3)
    ax_lat.legend(fontsize=8)
    return _save(fig, title, path)
