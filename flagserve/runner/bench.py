"""action=bench: benchmark the deployment this config describes, with baselines in the same run.

    python run.py --config-name serve action=bench [experiment.bench.request_rate=10 ...]
    python run.py -m --config-name serve action=bench serve.llm.engine_args.max_num_seqs=16,64,256

Uses the running deployment of this experiment when its serving graph is the configured one;
otherwise starts it, and stops it after the HTTP run (only what it started). The in-process
baselines then run with the deployment stopped, so they do not compete with it for CPU.
Results: <exp_dir>/bench/<time>[-<point>]/result.json, result.png, baselines.png. In a Hydra
multirun every point is one such run (its own deployment), and finish_sweep() writes the
combined table to <exp_dir>/bench/sweep-<time>/.

The benchmark itself lives in flagserve/bench (suite.py).
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flagserve.bench import suite
from flagserve.cluster.records import ExpPaths
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule
from flagserve.config.topology import served_engine_args, served_names, uses_gpu
from flagserve.runner.console import same_command
from flagserve.runner.deployment import Deployment

SWEEP: list[dict[str, Any]] = []  # one entry per bench run of this process (multirun points)


def _hydra_overrides() -> tuple[list[str], bool]:
    """(this job's command-line overrides without action=, whether it is a multirun point)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return [], False
    overrides = [o for o in hc.overrides.task if not o.startswith("action=")]
    return overrides, hc.mode == RunMode.MULTIRUN


def _swept_keys() -> set[str]:
    """Keys the multirun command line sweeps (a,b,c / range(...) / choice(...) / glob(...))."""
    keys = set()
    for arg in sys.argv[1:]:
        key, eq, value = arg.partition("=")
        if eq and not key.startswith("-") and ("," in value.strip("[]") and not value.startswith("[")
                                               or value.startswith(("range(", "choice(", "glob("))):
            keys.add(key.lstrip("+~"))
    return keys


def _short(override: str) -> str:
    key, _, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"


def _plain(data: Any) -> Any:
    return yaml.safe_load(yaml.safe_dump(data, sort_keys=True))


# What a bench measures of a deployment: its graph, how requests reach it, its processes'
# environment (the API key and the drain only decide who may ask and how it stops).
MEASURED = (("serve",), ("experiment", "runner", "deploy"), ("experiment", "envs"))
UNMEASURED = {"experiment.runner.deploy.api_key", "experiment.runner.deploy.drain_timeout_s"}


def config_differences(paths: ExpPaths, config: Config) -> list[str]:
    """Keys a bench measures whose value differs from what the running deployment was
    started with."""
    if not paths.config.exists():
        return []
    running = yaml.safe_load(paths.config.read_text()) or {}
    wanted = _plain(dataclasses.asdict(config))
    out: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if key in UNMEASURED:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif a != b:
            out.append(f"{key}: running {a!r}, configured {b!r}")

    for path in MEASURED:
        walk(_at(running, path), _at(wanted, path), ".".join(path))
    return out


def _at(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


@dataclass
class Job:
    """What one bench run sends and how it is labelled, worked out before anything starts."""
    settings: suite.Settings
    module: LLMModule
    model: str  # the served name the requests ask for
    engine_args: dict[str, Any]
    tokenizer: Any
    samples: list
    offsets: list
    overrides: list[str]  # this point's command-line overrides
    multirun: bool
    title: str = ""


def bench(deployment: Deployment) -> int:
    """HTTP passes against the deployment (started for them unless running), then the
    in-process baselines with it stopped; results saved and printed. Returns the exit code."""
    config = deployment.config
    running = deployment.is_running()
    if running:
        diff = config_differences(deployment.paths, config)
        if diff:
            print(f"{config.experiment.exp_name} is running with another serving graph:\n  "
                  + "\n  ".join(diff[:10]) + f"\nstop it first ({same_command('stop')}) or "
                  "bench it with the config it was started with", file=sys.stderr)
            return 1
        print(f"benchmarking the running deployment at {deployment.endpoint} (it stays running)")
    job = plan_job(config, deployment.hosts, earlier_runs(config) if running else 0)
    if not running and (code := deployment.run()) != 0:
        return code
    try:
        runs, more_http = _http_runs(config, deployment.endpoint, job)
    finally:
        if not running:
            deployment.stop()
    baselines: dict[str, Any] = {}
    if job.settings.baselines and runs:
        print(f"baselines in-process: {', '.join(job.settings.baselines)} ...", flush=True)
        # The served replica's cores: num_cpus, or by default (one replica) all of them.
        cpus = job.module.resources.num_cpus
        threads = None if uses_gpu(job.module, deployment.hosts) or not cpus else int(cpus)
        extra_runs, baselines = suite.run_baselines(runs[0], job.engine_args, job.tokenizer,
                                                    job.settings, job.samples, job.offsets,
                                                    threads, more_http)
        runs += extra_runs
    return _save(deployment, job, runs, baselines, started=not running)


def earlier_runs(config: Config) -> int:
    """Bench runs of this experiment so far (their result folders)."""
    root = Path(config.experiment.bench.result_dir or Path(config.experiment.exp_dir) / "bench")
    return sum(1 for p in root.iterdir() if p.is_dir()) if root.is_dir() else 0


def plan_job(config: Config, hosts: list[Host], seen: int = 0) -> Job:
    """The workload (tokenized with the model's tokenizer) and the run's title. `seen`: runs a
    running deployment has already served: their prompts are in its prefix cache, so this one
    draws its own (seed + 1000 x seen), or it would measure a warm cache."""
    b = config.experiment.bench
    module_id = b.module or next(iter(config.llms))
    module = config.llms[module_id]
    overrides, multirun = _hydra_overrides()
    settings = suite.Settings.from_config(b)
    if seen:
        settings.seed += 1000 * seen
        print(f"prompts drawn with seed {settings.seed}: the running deployment has served "
              f"{seen} earlier bench run(s) of this experiment, whose prompts it has cached")
    engine_args = served_engine_args(module, hosts).to_dict()
    from flagserve.models.tokenizer import load_tokenizer  # a directory or a .gguf file
    tokenizer = load_tokenizer(engine_args.get("tokenizer") or engine_args["model"])
    samples, offsets = suite.workload(settings, tokenizer)
    job = Job(settings, module, served_names(module_id, module)[0], engine_args, tokenizer,
              samples, offsets, overrides, multirun)
    rate = "inf" if settings.request_rate == float("inf") else settings.request_rate
    job.title = (f"{config.experiment.exp_name}: {job.model}, {settings.dataset} x{len(samples)}, "
                 f"rate {rate}"
                 + (f", max concurrency {settings.max_concurrency}" if settings.max_concurrency else "")
                 + (f" [{', '.join(overrides)}]" if overrides else ""))
    return job


def _http_runs(config: Config, url: str, job: Job) -> tuple[list, list]:
    """(the HTTP run of the workload, and of the comparison server if any; the further HTTP
    passes the baselines compare with)."""
    b, settings = config.experiment.bench, job.settings
    target = suite.Target(url, job.model, config.api_key, settings.endpoint, settings.ignore_eos)
    print(f"sending {len(job.samples)} requests to {target.url} ...", flush=True)
    runs = [suite.http_run("HTTP (FlagServe)", target, settings, job.samples, job.offsets)]
    more_http = suite.http_passes("HTTP (FlagServe)", target, settings, job.tokenizer)
    if b.compare_base_url:
        other = suite.Target(b.compare_base_url, b.compare_model or job.model, None,
                             settings.endpoint, settings.ignore_eos)
        print(f"sending the same requests to {other.url} ...", flush=True)
        runs.append(suite.http_run(f"HTTP ({b.compare_base_url})", other, settings, job.samples,
                                   job.offsets))
    return runs, more_http


def result_dir(config: Config, job: Job) -> Path:
    """<result_dir or exp_dir/bench>/<time>[-<swept overrides of this multirun point>]."""
    label = (",".join(_short(o) for o in job.overrides if o.partition("=")[0] in _swept_keys())
             if job.multirun else "")
    name = time.strftime("%Y%m%d-%H%M%S")
    name += f"-{re.sub(r'[^A-Za-z0-9_.=,-]+', '_', label)[:80]}" if label else ""
    return Path(config.experiment.bench.result_dir or Path(config.experiment.exp_dir) / "bench") / name


def _save(deployment: Deployment, job: Job, runs: list, baselines: dict[str, Any], started: bool) -> int:
    """Write and print the results; remember them for the multirun's table."""
    config, settings = deployment.config, job.settings
    out_dir = result_dir(config, job)
    files = suite.save(out_dir, job.title, settings, runs, baselines, {
        "experiment": config.experiment.exp_name, "model": job.model, "endpoint": deployment.endpoint,
        "overrides": job.overrides, "engine_args": job.engine_args, "started_deployment": started})
    print(suite.report.table(runs[0].metrics, prefix_cache=runs[0].prefix_cache,
                             request_rate=settings.request_rate, max_concurrency=settings.max_concurrency))
    for run in runs[1:]:
        if run.label.startswith("HTTP"):
            print(suite.report.table(run.metrics, title=run.label, prefix_cache=run.prefix_cache))
    for line in suite.baseline_lines(baselines):
        print(line)
    print(f"results: {files['json']}\nfigures: " + ", ".join(str(p) for k, p in files.items() if k != "json"))
    SWEEP.append({"overrides": job.overrides, "dir": str(out_dir), "result_dir": str(out_dir.parent),
                  "metrics": runs[0].metrics, "baselines": baselines, "title": job.title})
    return 0 if runs[0].metrics.completed else 1


def finish_sweep() -> None:
    """After a Hydra multirun: one table (and sweep.json, sweep.png) over every bench point."""
    if len(SWEEP) < 2:
        return
    keys: dict[str, list[str]] = {}
    for point in SWEEP:
        for o in point["overrides"]:
            k, _, v = o.partition("=")
            keys.setdefault(k, []).append(v)
    varying = [k for k, vs in keys.items() if len(set(vs)) > 1 or len(vs) < len(SWEEP)]
    rows, labels = [], []
    for point in SWEEP:
        values = dict(o.partition("=")[::2] for o in point["overrides"])
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={values.get(k, '-')}" for k in varying) or point["dir"]
        m = point["metrics"]
        labels.append(label)
        rows.append({"point": label, "ok": m.completed, "failed": m.failed,
                     "req/s": m.request_throughput, "out tok/s": m.output_throughput,
                     "TTFT p50": m.latency_ms["ttft"]["median"], "TTFT p99": m.latency_ms["ttft"]["p99"],
                     "TPOT p50": m.latency_ms["tpot"]["median"], "ITL p50": m.latency_ms["itl"]["median"],
                     "E2E p50": m.latency_ms["e2el"]["median"], "result": point["dir"]})
        if path := point["baselines"].get("serving_path"):  # what the path adds, per point
            rows[-1]["TTFT +ms"] = path["ttft_overhead_ms"]
            rows[-1]["ITL +%"] = path["itl_overhead_pct"]
    columns = [(k, k) for k in dict.fromkeys(k for r in rows for k in r) if k != "result"]
    out_dir = Path(SWEEP[0]["result_dir"]) / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    suite.report.write_json(out_dir / "sweep.json", {
        "varying": varying, "machine": suite.report.machine(),
        "points": [{**r, "metrics": p["metrics"].to_dict(), "baselines": p["baselines"]}
                   for r, p in zip(rows, SWEEP)]})
    suite.plot.plot_sweep(out_dir / "sweep.png", f"sweep over {', '.join(varying)}", labels,
                          [p["metrics"] for p in SWEEP])
    print(f"\n=== sweep: {len(SWEEP)} points (latencies in ms) ===")
    print(suite.report.comparison_table(rows, columns))
    print(f"sweep results: {out_dir / 'sweep.json'}, figure: {out_dir / 'sweep.png'}")
