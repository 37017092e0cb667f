"""One benchmark run with its baselines: what cli.py (benchmarks/serve.py) and action=bench do.

    workload   samples (datasets.py) + arrival offsets (schedule.py), built once and shared
    http       the workload against an OpenAI-compatible endpoint (client.py), with the
               prefix-cache hit rate from /metrics
    baselines  serving_path: the same workload straight into LLMEngine (inprocess.py)
               prefix_caching: a shared-prefix workload in-process, caching on vs off
               continuous_batching: engine vs HF generate (throughput.py)
    save       result.json, result.png (latency CDFs, throughput over time), baselines.png
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flagserve.bench import plot, prom, report
from flagserve.bench.client import Target, bench_http, warm_up
from flagserve.bench.datasets import SampleRequest, build_dataset, shared_prefix_dataset
from flagserve.bench.metrics import BenchmarkMetrics, RequestResult, compute
from flagserve.bench.schedule import arrival_offsets
from flagserve.config.schema import BenchBaseline, BenchDataset, BenchEndpoint


@dataclass
class Settings:
    """The workload; the fields of experiment.bench (flagserve.config.schema.BenchConfig)."""
    dataset: BenchDataset = "random"
    dataset_path: str | None = None
    num_prompts: int = 200
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 512
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    endpoint: BenchEndpoint = "completions"
    ignore_eos: bool = True
    seed: int = 0
    warmup: int = 2
    baselines: list[BenchBaseline] = field(default_factory=list)
    progress: bool = True
    repeats: int = 1  # passes of the serving_path comparison (each on prompts of seed + pass)
    num_prefixes: int = 1  # shared-prefix: distinct prefixes, one drawn per request

    @classmethod
    def from_config(cls, bench: Any) -> Settings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dataclasses.asdict(bench).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


@dataclass
class Run:
    """One pass of the workload through one path."""
    label: str
    results: list[RequestResult]
    duration: float
    metrics: BenchmarkMetrics
    prefix_cache: dict | None = None

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, **self.metrics.to_dict(), "prefix_cache": self.prefix_cache}

    def requests(self) -> list[dict[str, Any]]:
        return [{"start": r.start, "ttft": r.ttft, "latency": r.latency, "prompt_len": r.prompt_len,
                 "output_len": r.output_len, "cached_tokens": r.cached_tokens, "itl": r.itl,
                 "error": r.error} for r in self.results]


def workload(s: Settings, tokenizer: Any, pass_: int = 0) -> tuple[list[SampleRequest], list[float]]:
    """The prompts and arrival offsets of one pass (pass p draws with seed + p)."""
    seed = s.seed + pass_
    samples = build_dataset(s.dataset, tokenizer, s.num_prompts, s.input_len, s.output_len,
                            s.range_ratio, s.prefix_len, s.dataset_path, seed, s.num_prefixes)
    return samples, arrival_offsets(len(samples), s.request_rate, s.burstiness, seed)


@dataclass
class Pass:
    """One HTTP pass of serving_path and the workload it sent (the in-process pass replays it)."""
    http: Run
    samples: list[SampleRequest]
    offsets: list[float]


def http_passes(label: str, target: Target, s: Settings, tokenizer: Any) -> list[Pass]:
    """Passes 1 .. repeats-1 of the HTTP run (pass 0 is the main run), for serving_path."""
    if "serving_path" not in s.baselines:
        return []
    passes = []
    for p in range(1, s.repeats):
        samples, offsets = workload(s, tokenizer, p)
        passes.append(Pass(http_run(f"{label} pass {p}", target, s, samples, offsets), samples, offsets))
    return passes


def http_run(label: str, target: Target, s: Settings, samples: list[SampleRequest],
             offsets: list[float]) -> Run:
    start = prom.scrape(target.root, target.api_key)
    warm_tokens = warm_up(target, samples, s.warmup)
    before = prom.scrape_after(target.root, target.api_key, start, warm_tokens)  # warm-up excluded
    results, duration = bench_http(target, samples, offsets, s.max_concurrency, s.progress)
    metrics = compute(results, duration)
    after = prom.scrape_after(target.root, target.api_key, before, metrics.total_output_tokens)
    return Run(label, results, duration, metrics, prom.prefix_cache_delta(before, after))


# baselines (in-process engines: heavy imports stay inside)

def _engine(engine_args: dict[str, Any], **overrides: Any) -> Any:
    from flagserve.engine.engine_args import EngineArgs
    from flagserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs(**{**engine_args, **overrides}))


def _threads(num_threads: int | None) -> None:
    if num_threads:
        import torch
        torch.set_num_threads(num_threads)


def engine_run(label: str, engine: Any, s: Settings, samples: list[SampleRequest],
               offsets: list[float]) -> Run:
    from flagserve.bench.inprocess import bench_engine
    results, duration = bench_engine(engine, samples, offsets, s.max_concurrency, s.endpoint,
                                     s.ignore_eos, s.progress, s.warmup)
    metrics = compute(results, duration)
    queried = sum(r.prompt_len for r in results if r.success)
    hits = sum(r.cached_tokens or 0 for r in results if r.success)
    return Run(label, results, duration, metrics,
               {"queries": queried, "hits": hits, "hit_rate": hits / queried if queried else 0.0})


def _overheads(h: dict[str, dict[str, float]], e: dict[str, dict[str, float]]) -> dict[str, float | None]:
    def pct(k: str) -> float | None:
        return 100.0 * (h[k]["median"] / e[k]["median"] - 1) if e[k]["median"] else None
    return {"ttft_overhead_ms": h["ttft"]["median"] - e["ttft"]["median"],
            "itl_overhead_pct": pct("itl"), "tpot_overhead_pct": pct("tpot")}


def _median_stats(runs: list[Run]) -> dict[str, dict[str, float]]:
    """Each latency statistic as the median over runs (one run: its own)."""
    return {k: {stat: float(np.median([r.metrics.latency_ms[k][stat] for r in runs]))
                for stat in runs[0].metrics.latency_ms[k]}
            for k in ("ttft", "tpot", "itl", "e2el")}


def serving_path(passes: list[Pass], engine_args: dict[str, Any], s: Settings) -> tuple[Run, dict[str, Any]]:
    """Each pass's workload in-process (a fresh engine each: no pass sees another's prefix
    cache); what the HTTP path adds to median TTFT and ITL, as medians over the passes."""
    engine_runs = []
    for p in passes:
        engine = _engine(engine_args)
        engine_runs.append(engine_run("in-process engine", engine, s, p.samples, p.offsets))
        del engine
    http = [p.http for p in passes]
    h, e = _median_stats(http), _median_stats(engine_runs)
    summary = {
        "http": h, "engine": e, **_overheads(h, e),
        "http_output_throughput": http[0].metrics.output_throughput,
        "engine_output_throughput": engine_runs[0].metrics.output_throughput,
    }
    if len(http) > 1:
        summary["passes"] = [_overheads(a.metrics.latency_ms, b.metrics.latency_ms)
                             for a, b in zip(http, engine_runs)]
    return engine_runs[0], summary


def prefix_caching(engine_args: dict[str, Any], tokenizer: Any, s: Settings
                   ) -> tuple[list[Run], dict[str, Any]]:
    """A shared-prefix workload in-process with prefix caching on and off."""
    samples = shared_prefix_dataset(tokenizer, s.num_prompts, s.prefix_len, s.input_len,
                                    s.output_len, s.range_ratio, s.seed, s.num_prefixes)
    offsets = arrival_offsets(len(samples), s.request_rate, s.burstiness, s.seed)
    runs = []
    for on in (True, False):
        engine = _engine(engine_args, enable_prefix_caching=on)
        runs.append(engine_run(f"prefix caching {'on' if on else 'off'}", engine, s, samples, offsets))
        del engine
    on, off = runs
    summary = {
        "prefix_len": s.prefix_len, "input_len": s.input_len, "num_prompts": len(samples),
        "on": {k: on.metrics.latency_ms[k] for k in ("ttft", "e2el")},
        "off": {k: off.metrics.latency_ms[k] for k in ("ttft", "e2el")},
        "on_hit_rate": on.prefix_cache["hit_rate"] if on.prefix_cache else None,
        "ttft_ratio": (off.metrics.latency_ms["ttft"]["median"]
                       / max(on.metrics.latency_ms["ttft"]["median"], 1e-9)),
        "on_output_throughput": on.metrics.output_throughput,
        "off_output_throughput": off.metrics.output_throughput,
    }
    return runs, summary


def continuous_batching(engine_args: dict[str, Any], tokenizer: Any, samples: list[SampleRequest],
                        endpoint: BenchEndpoint) -> dict[str, Any]:
    """The bench's prompts offline: FlagServe's engine vs HF generate (throughput.py)."""
    from flagserve.bench.inprocess import encode
    from flagserve.bench.throughput import Workload, compare
    from flagserve.entrypoints.openai.tokenizer import PromptTokenizer

    prompt_tokenizer = PromptTokenizer(tokenizer)
    prompts = [encode(prompt_tokenizer, s, endpoint) for s in samples]
    limit = engine_args.get("max_model_len") or 10**9
    work = Workload(prompts, [s.output_len or max(1, limit - len(p)) for s, p in zip(samples, prompts)])
    args = {k: v for k, v in engine_args.items() if k not in ("model", "dtype", "max_num_seqs",
                                                               "max_num_batched_tokens", "attention_backend")}
    dtype = engine_args.get("dtype") or "float32"
    return compare(engine_args["model"], work, dtype=dtype if dtype != "auto" else "float32",
                   max_num_seqs=engine_args.get("max_num_seqs", 256),
                   max_num_batched_tokens=engine_args.get("max_num_batched_tokens"),
                   backend=engine_args.get("attention_backend", "auto"), **args)


def run_baselines(http: Run, engine_args: dict[str, Any], tokenizer: Any, s: Settings,
                  samples: list[SampleRequest], offsets: list[float],
                  num_threads: int | None = None, more_http: list[Pass] | None = None
                  ) -> tuple[list[Run], dict[str, Any]]:
    """The baselines named in s.baselines, in-process (the deployment should be stopped or idle).
    more_http: the HTTP passes 1.. (http_passes) of serving_path, when s.repeats > 1."""
    _threads(num_threads)
    runs: list[Run] = []
    out: dict[str, Any] = {}
    if "serving_path" in s.baselines:
        passes = [Pass(http, samples, offsets), *(more_http or [])]
        run, out["serving_path"] = serving_path(passes, engine_args, s)
        runs.append(run)
    if "prefix_caching" in s.baselines:
        pc_runs, out["prefix_caching"] = prefix_caching(engine_args, tokenizer, s)
        runs += pc_runs
    if "continuous_batching" in s.baselines:
        out["continuous_batching"] = continuous_batching(engine_args, tokenizer, samples, s.endpoint)
    return runs, out


def baseline_lines(baselines: dict[str, Any]) -> list[str]:
    lines = []
    if sp := baselines.get("serving_path"):
        itl = sp["itl_overhead_pct"]
        passes = sp.get("passes")
        over = f", medians of {len(passes)} passes" if passes else ""
        h, e = sp["http"], sp["engine"]
        lines.append(f"serving path{over}: median TTFT {h['ttft']['median']:.2f} ms via HTTP vs "
                     f"{e['ttft']['median']:.2f} ms in-process (+{sp['ttft_overhead_ms']:.2f} ms); "
                     f"median ITL {h['itl']['median']:.3f} vs {e['itl']['median']:.3f} ms "
                     f"({itl:+.1f}%)" if itl is not None else "")
        if passes:
            lines.append("  per pass: " + "; ".join(
                f"TTFT +{p['ttft_overhead_ms']:.2f} ms, ITL {p['itl_overhead_pct']:+.1f}%" for p in passes))
    if pc := baselines.get("prefix_caching"):
        lines.append(f"prefix caching ({pc['prefix_len']}-token shared prefix): median TTFT "
                     f"{pc['on']['ttft']['median']:.2f} ms on vs {pc['off']['ttft']['median']:.2f} ms off "
                     f"({pc['ttft_ratio']:.2f}x), hit rate {100 * (pc['on_hit_rate'] or 0):.1f}%")
    if cb := baselines.get("continuous_batching"):
        line = f"continuous batching: FlagServe {cb['flagserve_output_tps']:.0f} output tok/s"
        if cb.get("hf_output_tps"):
            line += f" vs HF generate {cb['hf_output_tps']:.0f} tok/s ({cb['ratio']:.2f}x)"
        lines.append(line)
    return lines


def save(out_dir: str | Path, title: str, s: Settings, runs: list[Run], baselines: dict[str, Any],
         extra: dict[str, Any] | None = None) -> dict[str, Path]:
    """result.json (every run, baselines, machine), result.png and baselines.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "result.json", "figure": out_dir / "result.png"}
    result = {"title": title, "machine": report.machine(), "settings": s.to_dict(), **(extra or {}),
              "runs": [r.summary() for r in runs], "baselines": baselines,
              "requests": {r.label: r.requests() for r in runs}}
    report.write_json(files["json"], result)
    # The figure compares the HTTP run(s) with the in-process run of the same workload.
    same_workload = [r for r in runs if not r.label.startswith("prefix caching")]
    plot.plot_run(files["figure"], title, {r.label: (r.results, r.duration) for r in same_workload})
    if baselines:
        path = plot.plot_baselines(out_dir / "baselines.png", title, baselines)
        if path:
            files["baselines"] = path
    return files
