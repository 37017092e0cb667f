"""Issue 15's serving benchmark, end to end: deployments started and stopped by run.py, the
serving benchmark's client (flagserve/bench) against each, one table with ratios.

    .venv/bin/python benchmarks/disagg_routing.py            # the default model (SmolLM2)
    .venv/bin/python benchmarks/disagg_routing.py --tiny     # the tiny model: checks the script

1. Long prompts among ongoing decodes, same total resources: `aggregated` (2 engine replicas,
   each prefills and decodes) vs `disaggregated` (1 prefill + 1 decode replica, KV over gloo).
   Short prompts with long outputs keep decodes running while long prompts arrive; an
   aggregated replica runs a long prompt's prefill in the batch of its decodes (their ITL
   stretches by the prefill's step), a decode replica never prefills. Reported: ITL of the
   ongoing decodes (median, p99), TTFT of the long and of the short prompts.
2. Routing across 2 aggregated replicas on a shared-prefix workload (--num-prefixes system
   prompts, one drawn per request): `prefix_aware` (the aggregated deployment above, its
   default router) vs `round_robin`: TTFT and the prefix-cache hit rate from /metrics.

Every engine replica gets an equal share of the host's cores (Ray's num_cpus), the ingress
none; each deployment is stopped before the next starts.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from flagserve.bench import suite
from flagserve.bench.cli import served_model
from flagserve.bench.client import Target, warm_up
from flagserve.bench.datasets import PromptMaker, SampleRequest, shared_prefix_dataset
from flagserve.bench.metrics import compute
from flagserve.bench.schedule import arrival_offsets
from flagserve.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ["+serve.llm.disaggregation.prefill.num_replicas=1",
         "+serve.llm.disaggregation.decode.num_replicas=1"]
TWO = ["serve.llm.resources.num_replicas=2"]
STALL_MS = 1000  # an ITL gap this long is a decode stalled behind a prefill


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny model (fast; shows no contention)")
    p.add_argument("--port", type=int, default=8793)
    p.add_argument("--long-len", type=int, default=2000, help="tokens of a long prompt")
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--num-short", type=int, default=12, help="short prompts that decode long")
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--rate", type=float, default=0.5, help="mixed workload, requests/s (Poisson)")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=48, help="shared-prefix requests")
    p.add_argument("--max-concurrency", type=int, default=4, help="shared-prefix requests in flight")
    p.add_argument("--kv-gib", type=float, default=1.0, help="cpu_kv_cache_space_gib per engine")
    p.add_argument("--out", default="outputs/disagg_routing", help="results JSON goes here")
    return p.parse_args()


class Deployment:
    """One experiment of its own (name, folder, port), started by run.py and always stopped."""

    def __init__(self, args: argparse.Namespace, name: str, overrides: list[str]):
        self.name, self.url = name, f"http://127.0.0.1:{args.port}"
        exp = f"pdbench-{name}-{uuid.uuid4().hex[:6]}"
        graph = ["serve=tiny"] if args.tiny else []
        self.args = ["--config-name", "serve", *graph, f"experiment.exp_name={exp}",
                     f"experiment.exp_dir={ROOT / args.out / exp}",
                     f"experiment.runner.deploy.port={args.port}",
                     f"serve.llm.engine_args.cpu_kv_cache_space_gib={args.kv_gib}", *overrides]

    def run_py(self, action: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "run.py", *self.args, f"action={action}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def __enter__(self) -> Target:
        started = time.time()
        result = self.run_py("run", 900)
        if result.returncode != 0:
            self.run_py("stop", 300)
            raise RuntimeError(f"{self.name} did not start:\n{result.stdout}\n{result.stderr}")
        print(f"[{self.name}] started in {time.time() - started:.0f} s", flush=True)
        return Target(self.url, served_model(self.url, None)["id"], None, "completions", True)

    def __exit__(self, *exc: Any) -> None:
        result = self.run_py("stop", 300)
        print(f"[{self.name}] stopped (rc {result.returncode})", flush=True)


def settings(n: int, rate: float, concurrency: int | None) -> suite.Settings:
    # warm() instead of the suite's warm-up, which sends the first counted prompts (their
    # prefixes would then be cached before the run)
    return suite.Settings(num_prompts=n, request_rate=rate, max_concurrency=concurrency,
                          warmup=0, progress=False)


def warm(target: Target, tok: Any) -> None:
    """Two requests of prompts of their own: first steps, and a disaggregated pair's link."""
    maker = PromptMaker(tok, seed=99)
    warm_up(target, [SampleRequest(maker.text(60), 61, 8) for _ in range(2)], 2)


def mixed_workload(tok: Any, args: argparse.Namespace, long_len: int) -> list[SampleRequest]:
    """Short prompts decoding `short_output` tokens and long prompts of `long_len` tokens
    with 8, shuffled (seeded): the long ones arrive while decodes are under way."""
    maker = PromptMaker(tok, seed=0)
    short_len = 64
    samples = [SampleRequest(maker.text(short_len - maker.num_special), short_len, args.short_output)
               for _ in range(args.num_short)]
    samples += [SampleRequest(maker.text(long_len - maker.num_special), long_len, 8)
                for _ in range(args.num_long)]
    rest = samples[1:]
    random.Random(0).shuffle(rest)
    return samples[:1] + rest  # a decode is running before the first long prompt


def run_mixed(target: Target, tok: Any, args: argparse.Namespace, long_len: int) -> dict:
    samples = mixed_workload(tok, args, long_len)
    warm(target, tok)
    offsets = arrival_offsets(len(samples), args.rate, 1.0, 0)
    run = suite.http_run("mixed", target, settings(len(samples), args.rate, None), samples, offsets)
    short = [r for r in run.results if r.prompt_len < long_len]
    long = [r for r in run.results if r.prompt_len >= long_len]
    ms = {k: compute(v, run.duration).latency_ms for k, v in (("short", short), ("long", long))}
    # A stall hits the few decodes running during one prefill step: a handful of gaps among
    # thousands, under p99; the largest gaps and the count of long ones show it.
    gaps = np.array([g for r in short for g in r.itl]) * 1000
    return {"decode_itl_p50": ms["short"]["itl"]["median"], "decode_itl_p99": ms["short"]["itl"]["p99"],
            "decode_itl_p999": float(np.percentile(gaps, 99.9)), "decode_itl_max": float(gaps.max()),
            "decode_stalls": int((gaps > STALL_MS).sum()), "decode_gaps": int(gaps.size),
            "long_ttft_p50": ms["long"]["ttft"]["median"], "long_ttft_p99": ms["long"]["ttft"]["p99"],
            "short_ttft_p50": ms["short"]["ttft"]["median"], "short_ttft_p99": ms["short"]["ttft"]["p99"],
            "output_tok_s": run.metrics.output_throughput, "duration_s": run.duration,
            "failed": run.metrics.failed, "load": os.getloadavg()[0]}


def run_prefix(target: Target, tok: Any, args: argparse.Namespace) -> dict:
    samples = shared_prefix_dataset(tok, args.num_prompts, args.prefix_len, 32, 16, seed=0,
                                    num_prefixes=args.num_prefixes)
    warm(target, tok)
    run = suite.http_run("shared-prefix", target, settings(len(samples), float("inf"),
                                                           args.max_concurrency),
                         samples, [0.0] * len(samples))
    ttft = run.metrics.latency_ms["ttft"]
    return {"hit_rate": (run.prefix_cache or {}).get("hit_rate"), "ttft_p50": ttft["median"],
            "ttft_mean": ttft["mean"], "ttft_p99": ttft["p99"], "duration_s": run.duration,
            "failed": run.metrics.failed, "load": os.getloadavg()[0]}


def table(title: str, rows: list[tuple[str, str]], a: tuple[str, dict], b: tuple[str, dict]) -> str:
    lines = [f"{title}", f"| | {a[0]} | {b[0]} | {b[0]} / {a[0]} |", "|---|---|---|---|"]
    for key, label in rows:
        x, y = a[1].get(key), b[1].get(key)
        ratio = f"{y / x:.2f}" if isinstance(x, float) and isinstance(y, float) and x else "-"
        lines.append(f"| {label} | {_fmt(key, x)} | {_fmt(key, y)} | {ratio} |")
    return "\n".join(lines)


def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if key == "hit_rate":
        return f"{v:.3f}"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}"


MIXED_ROWS = [("decode_itl_p50", "ITL of ongoing decodes, median (ms)"),
              ("decode_itl_p99", "ITL of ongoing decodes, p99 (ms)"),
              ("decode_itl_p999", "ITL of ongoing decodes, p99.9 (ms)"),
              ("decode_itl_max", "ITL of ongoing decodes, max (ms)"),
              ("decode_stalls", f"decode gaps over {STALL_MS} ms"),
              ("decode_gaps", "decode gaps (all)"),
              ("long_ttft_p50", "TTFT of long prompts, median (ms)"),
              ("long_ttft_p99", "TTFT of long prompts, p99 (ms)"),
              ("short_ttft_p50", "TTFT of short prompts, median (ms)"),
              ("short_ttft_p99", "TTFT of short prompts, p99 (ms)"),
              ("output_tok_s", "output tokens/s"), ("duration_s", "duration (s)"),
              ("failed", "failed requests"), ("load", "load average (1 min) after")]
PREFIX_ROWS = [("hit_rate", "prefix-cache hit rate (/metrics)"), ("ttft_p50", "TTFT median (ms)"),
               ("ttft_mean", "TTFT mean (ms)"), ("ttft_p99", "TTFT p99 (ms)"),
               ("duration_s", "duration (s)"), ("failed", "failed requests"),
               ("load", "load average (1 min) after")]


def main() -> int:
    args = parse_args()
    long_len = min(args.long_len, 1900) if args.tiny else args.long_len
    out: dict[str, Any] = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    with Deployment(args, "aggregated", TWO) as target:
        tok = load_tokenizer(served_model(target.root, None)["root"])
        out["aggregated"] = run_mixed(target, tok, args, long_len)
        out["prefix_aware"] = run_prefix(target, tok, args)
    with Deployment(args, "round_robin", [*TWO, "serve.llm.router.strategy=round_robin"]) as target:
        out["round_robin"] = run_prefix(target, tok, args)
    with Deployment(args, "disaggregated", SPLIT) as target:
        out["disaggregated"] = run_mixed(target, tok, args, long_len)
    path = ROOT / args.out / f"result-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(table(f"\nlong prompts ({long_len} tokens) among ongoing decodes", MIXED_ROWS,
                ("aggregated", out["aggregated"]), ("disaggregated", out["disaggregated"])))
    print(table(f"\nshared-prefix, {args.num_prefixes} prefixes of {args.prefix_len} tokens, 2 replicas",
                PREFIX_ROWS, ("round_robin", out["round_robin"]), ("prefix_aware", out["prefix_aware"])))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
