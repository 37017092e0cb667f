"""FlagServe's and vLLM's OpenAI servers under the same client, on this host (issue 16).

    python benchmarks/compare_vllm_served.py --vllm-python /tmp/vllm-venv/bin/python

One server at a time, each with its defaults: FlagServe's default experiment (`run.py
--config-name serve`, SmolLM2 from its GGUF) and vLLM's api_server on the same weights in
float32 with its CPU guide's runtime (compare_vllm's settings). Each is sent the same
workloads by benchmarks/serve.py's client (default 100 random requests, 128 tokens in / 64
out) at every --rates entry (req/s, `inf` = all at once); every run draws its own prompts
(seed + run index), so no run measures a prefix cache the previous one filled.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from flagserve.bench.client import Target
from flagserve.bench.metrics import BenchmarkMetrics
from flagserve.bench.suite import Settings, http_run, workload
from flagserve.bench.vllm_compare import hf_directory, vllm_env
from flagserve.cluster import http

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "compare-vllm-served"


def wait_healthy(root: str, alive, timeout_s: float) -> None:
    if not http.wait_healthy(root, timeout_s, alive):
        raise RuntimeError(f"{root} not healthy: its server exited, or {timeout_s:.0f} s passed")


@contextlib.contextmanager
def flagserve_server(port: int, extra: list[str]) -> Iterator[str]:
    overrides = [f"experiment.runner.deploy.port={port}", f"experiment.exp_name={EXPERIMENT}",
                 *extra]
    run = [sys.executable, "run.py", "--config-name", "serve", *overrides]
    subprocess.run([*run, "action=run"], cwd=ROOT, check=True)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, lambda: True, 300)
        yield root
    finally:
        subprocess.run([*run, "action=stop"], cwd=ROOT, check=False)


@contextlib.contextmanager
def vllm_server(python: str, model: str, port: int, kv_gib: int) -> Iterator[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "float32", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    # Its own session: the api_server and its engine-core child stop together, by this pid.
    proc = subprocess.Popen(cmd, env=vllm_env(python, kv_gib), start_new_session=True)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, lambda: proc.poll() is None, 900)
        yield root
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_server(root: str, model: str, args: argparse.Namespace) -> dict[str, BenchmarkMetrics]:
    """{rate: metrics} of one server, the runs in --rates order."""
    from flagserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    served = http.get(f"{root}/v1/models", timeout=30)
    target = Target(root, json.loads(served)["data"][0]["id"])
    out = {}
    for i, (rate, name) in enumerate(zip(args.rates, run_names(args.rates), strict=True)):
        s = Settings(num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, request_rate=rate, seed=args.seed + i,
                     progress=False)
        samples, offsets = workload(s, tokenizer)
        out[name] = http_run(name, target, s, samples, offsets).metrics
    return out


def rate_name(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def run_names(rates: list[float]) -> list[str]:
    """One row name per run: a rate given more than once is numbered (`4 req/s #2`), since
    TTFT near saturation differs 2x between runs and one run of each engine settles nothing."""
    names = [rate_name(r) for r in rates]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(f"{name} #{seen[name]}" if names.count(name) > 1 else name)
    return out


def table(results: dict[str, dict[str, BenchmarkMetrics]]) -> str:
    rows = ["| rate | engine | output tok/s | median TTFT ms | median ITL ms | p99 TTFT ms |",
            "|---|---|---|---|---|---|"]
    for rate in next(iter(results.values())):
        for engine in results:
            m = results[engine][rate]
            lat = m.latency_ms
            rows.append(f"| {rate} | {engine} | {m.output_throughput:.1f} | "
                        f"{lat['ttft']['median']:.0f} | {lat['itl']['median']:.0f} | "
                        f"{lat['ttft']['p99']:.0f} |")
        ours, theirs = (results.get(e, {}).get(rate) for e in ("flagserve", "vllm"))
        if ours is None or theirs is None:
            continue
        rows.append(f"| {rate} | FlagServe / vLLM | "
                    f"{ours.output_throughput / theirs.output_throughput:.2f}x | "
                    + " | ".join(f"{ours.latency_ms[k][q] / theirs.latency_ms[k][q]:.2f}x"
                                 for k, q in (("ttft", "median"), ("itl", "median"),
                                              ("ttft", "p99"))) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the interpreter of vLLM's venv")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, math.inf],
                        help="req/s of each run (inf: all at once); repeat one to run it again")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", nargs="+", choices=["flagserve", "vllm"],
                        default=["flagserve", "vllm"])
    parser.add_argument("--flagserve-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a run.py override of FlagServe's experiment (repeatable), e.g. "
                             "serve.llm.engine_args.max_num_seqs=128")
    args = parser.parse_args()
    if "vllm" in args.engines and not args.vllm_python:
        parser.error("--vllm-python is needed to run vllm (or --engines flagserve)")
    from flagserve.models.packaged import smollm2_gguf

    model = hf_directory(str(smollm2_gguf()))
    results = {}
    if "flagserve" in args.engines:
        with flagserve_server(args.port, args.flagserve_override) as root:
            results["flagserve"] = bench_server(root, model, args)
    if "vllm" in args.engines:
        with vllm_server(args.vllm_python, model, args.port, args.kv_cache_gib) as root:
            results["vllm"] = bench_server(root, model, args)
    print(table(results), flush=True)
