"""FlagServe's and vLLM's OpenAI servers under the same client, on this host (issue 16).

    python benchmarks/compare_vllm_served.py --vllm-python /tmp/vllm-venv/bin/python

Both servers up at once, each with its defaults: FlagServe's default experiment (`run.py
--config-name serve`, SmolLM2 from its GGUF) on --port and vLLM's api_server on the same
weights in float32 with its CPU guide's runtime (compare_vllm's settings) on --port + 1. Each
--rates entry (req/s, `inf` = all at once) is one run: its workload (benchmarks/serve.py's
client; default 100 random requests, 128 tokens in / 64 out) goes to one server, then the
same to the other, the first alternating from run to run, the other server's processes
stopped meanwhile (SIGSTOP): idle, FlagServe's Ray daemons and Serve's loops took ~11% of a
core and vLLM's ~1.5% (docs/performance.md, CPU), which would come out of the running
engine's time. The VM's speed drifts by tens of percent over minutes, so a ratio is of runs
minutes apart at most, not of one engine's block of runs against the other's. Every run
draws its own prompts (seed + run index), so no run measures a prefix cache the previous one
filled.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from flagserve.bench.args import positive_int, positive_rate, vllm_python
from flagserve.bench.client import Target
from flagserve.bench.metrics import BenchmarkMetrics
from flagserve.bench.suite import Settings, http_run, workload
from flagserve.bench.vllm_compare import hf_directory, vllm_env
from flagserve.cluster import http
from flagserve.cluster.records import ExpPaths, ProcessRecord, load_processes
from flagserve.cluster.sessions import session_members

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "compare-vllm-served"
STOP_WAIT_S = 5.0  # for a SIGSTOP to take effect


def wait_healthy(root: str, alive, timeout_s: float) -> None:
    if not http.wait_healthy(root, timeout_s, alive):
        raise RuntimeError(f"{root} not healthy: its server exited, or {timeout_s:.0f} s passed")


@dataclass
class Server:
    root: str  # e.g. http://127.0.0.1:8123
    processes: Callable[[], list[psutil.Process]]  # all of its processes, now


@contextlib.contextmanager
def flagserve_server(port: int, extra: list[str]) -> Iterator[Server]:
    exp_dir = ROOT / "outputs" / EXPERIMENT
    overrides = [f"experiment.runner.deploy.port={port}", f"experiment.exp_name={EXPERIMENT}",
                 f"experiment.exp_dir={exp_dir}", *extra]
    run = [sys.executable, "run.py", "--config-name", "serve", *overrides]
    subprocess.run([*run, "action=run"], cwd=ROOT, check=True)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, lambda: True, 300)
        yield Server(root, lambda: [p for record in load_processes(ExpPaths(exp_dir))
                                    for p in session_members(record)])
    finally:
        subprocess.run([*run, "action=stop"], cwd=ROOT, check=False)


@contextlib.contextmanager
def vllm_server(python: str, model: str, port: int, kv_gib: int) -> Iterator[Server]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "float32", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    # Its own session: the api_server and its engine-core child stop together, by this pid.
    proc = subprocess.Popen(cmd, env=vllm_env(python, kv_gib), start_new_session=True)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, lambda: proc.poll() is None, 900)
        record = ProcessRecord("vllm", proc.pid, psutil.Process(proc.pid).create_time(), cmd,
                               None)
        yield Server(root, lambda: session_members(record))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_stopped(proc: psutil.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(psutil.Error):
        while proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)


@contextlib.contextmanager
def paused(servers: list[Server]) -> Iterator[None]:
    """These servers' processes stopped (SIGSTOP) while another one is measured, continued
    after, also when the run fails. A whole FlagServe session stopped for a minute answered
    at once after, its deployments healthy: Serve's controller and health checks stop too."""
    procs = [p for server in servers for p in server.processes()]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.suspend()
    for proc in procs:  # a signal takes effect when its process next runs: until then, not paused
        wait_stopped(proc, STOP_WAIT_S)
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.resume()


def bench(servers: dict[str, Server], model: str, args: argparse.Namespace
          ) -> tuple[dict[str, dict[str, BenchmarkMetrics]], dict[str, float]]:
    """({engine: {run: metrics}}, {run: when its last request is sent}): each run's workload
    through every server in turn, the others paused (module docstring), the runs in --rates
    order."""
    from flagserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    targets = {engine: Target(server.root, served_model(server.root))
               for engine, server in servers.items()}
    out: dict[str, dict[str, BenchmarkMetrics]] = {engine: {} for engine in servers}
    last_sends: dict[str, float] = {}
    for i, (rate, name) in enumerate(zip(args.rates, run_names(args.rates), strict=True)):
        s = Settings(num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, request_rate=rate, seed=args.seed + i,
                     progress=False)
        samples, offsets = workload(s, tokenizer)
        last_sends[name] = max(offsets, default=0.0)
        for engine in alternate(list(servers), i):
            with paused([server for other, server in servers.items() if other != engine]):
                out[engine][name] = http_run(name, targets[engine], s, samples, offsets).metrics
    return out, last_sends


def served_model(root: str) -> str:
    return json.loads(http.get(f"{root}/v1/models", timeout=30))["data"][0]["id"]


def alternate(engines: list[str], run: int) -> list[str]:
    """The order the engines take run `run`: as given, then reversed, and so on."""
    return engines if run % 2 == 0 else engines[::-1]


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


def table(results: dict[str, dict[str, BenchmarkMetrics]],
          last_sends: dict[str, float] | None = None) -> str:
    """The runs' figures per engine and FlagServe's ratios to vLLM's. `arrivals' bound`: the
    most any server could reach when its last request is sent at last_sends[run] (it cannot
    finish before): that output tok/s in an engine's row, that over vLLM's in a ratio row. At
    a rate that both engines keep up with, the ratio's target has to stay under it."""
    last_sends = last_sends or {}
    rows = ["| rate | engine | output tok/s | median TTFT ms | median ITL ms | p99 TTFT ms "
            "| arrivals' bound |", "|---|---|---|---|---|---|---|"]
    for rate in next(iter(results.values())):
        last = last_sends.get(rate, 0.0)
        for engine in results:
            m = results[engine][rate]
            lat = m.latency_ms
            bound = f"{m.total_output_tokens / last:.1f}" if last > 0 else "-"
            rows.append(f"| {rate} | {engine} | {m.output_throughput:.1f} | "
                        f"{lat['ttft']['median']:.0f} | {lat['itl']['median']:.0f} | "
                        f"{lat['ttft']['p99']:.0f} | {bound} |")
        ours, theirs = (results.get(e, {}).get(rate) for e in ("flagserve", "vllm"))
        if ours is None or theirs is None:
            continue
        bound = f"{theirs.duration_s / last:.2f}x" if last > 0 else "-"
        rows.append(f"| {rate} | FlagServe / vLLM | "
                    f"{ours.output_throughput / theirs.output_throughput:.2f}x | "
                    + " | ".join(f"{ours.latency_ms[k][q] / theirs.latency_ms[k][q]:.2f}x"
                                 for k, q in (("ttft", "median"), ("itl", "median"),
                                              ("ttft", "p99"))) + f" | {bound} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=vllm_python, help="the interpreter of vLLM's venv")
    parser.add_argument("--rates", type=positive_rate, nargs="+", default=[4.0, math.inf],
                        help="req/s of each run (inf: all at once); repeat one to run it again")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--port", type=int, default=8123, help="FlagServe's; vLLM's is the next")
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
    with contextlib.ExitStack() as stack:
        servers = {}
        if "flagserve" in args.engines:
            servers["flagserve"] = stack.enter_context(
                flagserve_server(args.port, args.flagserve_override))
        if "vllm" in args.engines:
            servers["vllm"] = stack.enter_context(
                vllm_server(args.vllm_python, model, args.port + 1, args.kv_cache_gib))
        results, last_sends = bench(servers, model, args)
    print(table(results, last_sends), flush=True)
