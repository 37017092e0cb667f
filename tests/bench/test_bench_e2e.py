"""The serving benchmark against a real deployment (run.py action=run, shared by this module):
the CLI (benchmarks/serve.py), action=bench on the running deployment, a Hydra multirun sweep,
and the refusal to bench a deployment started with another serving graph."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.serve.conftest import REPO, free_port, kill_recorded, run_py

SMALL = ["experiment.bench.num_prompts=8", "experiment.bench.input_len=24",
         "experiment.bench.output_len=6", "experiment.bench.warmup=1",
         "experiment.bench.progress=false"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    exp_dir = tmp_path_factory.mktemp("bench")
    port = free_port()
    args = ["--config-name", "serve", "serve=tiny", f"experiment.exp_name=bench-{uuid.uuid4().hex[:8]}",
            f"experiment.exp_dir={exp_dir}", f"experiment.runner.deploy.port={port}",
            "serve.llm.engine_args.max_num_seqs=8", "serve.llm.engine_args.max_model_len=512"]
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, f"run failed:\n{result.stdout}\n{result.stderr}"
        yield {"url": f"http://127.0.0.1:{port}", "exp_dir": exp_dir, "args": args}
    finally:
        if run_py(*args, "action=stop", timeout=120).returncode != 0:
            kill_recorded(exp_dir)


def only_result(root: Path) -> dict:
    files = sorted(root.glob("*/result.json"))
    assert files, f"no result under {root}"
    return json.loads(files[-1].read_text())


def test_cli_against_endpoint(server, tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--base-url", server["url"], "--num-prompts", "10",
         "--input-len", "32", "--output-len", "8", "--request-rate", "40", "--max-concurrency", "4",
         "--result-dir", str(tmp_path), "--baselines", "serving_path",
         "--engine-arg", "max_model_len=512", "--num-threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Serving Benchmark Result" in out.stdout and "Median TTFT (ms)" in out.stdout
    assert "serving path: median TTFT" in out.stdout
    result = only_result(tmp_path)
    http, engine = result["runs"][0], result["runs"][1]
    assert http["completed"] == 10 and http["failed"] == 0
    assert http["total_input_tokens"] == 320 and http["total_output_tokens"] == 80  # exact lengths
    assert http["max_concurrent_requests"] <= 4
    assert http["prefix_cache"]["queries"] == 320  # /metrics delta of exactly this run
    assert engine["label"] == "in-process engine" and engine["total_output_tokens"] == 80
    assert sum(len(r["itl"]) for r in result["requests"]["HTTP"]) > 0  # chunks may merge under load
    sp = result["baselines"]["serving_path"]
    assert sp["ttft_overhead_ms"] == pytest.approx(
        sp["http"]["ttft"]["median"] - sp["engine"]["ttft"]["median"])
    assert "loadavg_1_5_15" in result["machine"]
    for png in ("result.png", "baselines.png"):
        assert (next(tmp_path.glob("*")) / png).stat().st_size > 10_000


def test_action_bench_uses_running_deployment(server):
    out = run_py(*server["args"], "action=bench", *SMALL, "experiment.bench.dataset=shared-prefix",
                 "experiment.bench.prefix_len=64", "experiment.bench.endpoint=chat",
                 "experiment.bench.baselines=[prefix_caching]", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "benchmarking the running deployment" in out.stdout and "Prefix cache hit rate" in out.stdout
    result = only_result(server["exp_dir"] / "bench")
    assert result["started_deployment"] is False and result["runs"][0]["completed"] == 8
    assert result["runs"][0]["prefix_cache"]["hit_rate"] > 0.3  # the shared 64-token system prompt
    pc = result["baselines"]["prefix_caching"]
    assert pc["on_hit_rate"] > 0.3 and pc["ttft_ratio"] > 0
    assert run_py(*server["args"], "action=status").returncode == 0  # still running


def test_serving_path_repeats_are_medians_over_passes(server):
    out = run_py(*server["args"], "action=bench", *SMALL, "experiment.bench.baselines=[serving_path]",
                 "experiment.bench.repeats=3", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "serving path, medians of 3 passes" in out.stdout and "per pass: " in out.stdout
    sp = only_result(server["exp_dir"] / "bench")["baselines"]["serving_path"]
    assert len(sp["passes"]) == 3
    assert sp["ttft_overhead_ms"] == pytest.approx(
        sp["http"]["ttft"]["median"] - sp["engine"]["ttft"]["median"])


def test_multirun_sweep_gives_one_result_per_point_and_a_table(server):
    out = run_py("-m", *server["args"], "action=bench", *SMALL, "experiment.bench.baselines=[]",
                 "experiment.bench.request_rate=50,inf", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "=== sweep: 2 points" in out.stdout
    assert "request_rate=50" in out.stdout and "request_rate=inf" in out.stdout
    sweeps = sorted((server["exp_dir"] / "bench").glob("sweep-*/sweep.json"))
    points = json.loads(sweeps[-1].read_text())["points"]
    assert len(points) == 2 and all(p["ok"] == 8 for p in points)
    assert all(Path(p["result"], "result.json").exists() for p in points)
    # each point against the running deployment draws prompts it has not cached yet
    seeds = [json.loads(Path(p["result"], "result.json").read_text())["settings"]["seed"] for p in points]
    assert seeds[0] != seeds[1] and "prompts drawn with seed" in out.stdout


def test_refuses_a_deployment_with_another_graph(server):
    out = run_py(*server["args"][:-2], "serve.llm.engine_args.max_num_seqs=4",
                 "serve.llm.engine_args.max_model_len=512", "action=bench", *SMALL, timeout=120)
    assert out.returncode == 1
    assert "serve.llm.engine_args.max_num_seqs: running 8, configured 4" in out.stderr
    # how requests reach it is measured too: a bench labelled serve_proxy must go through one
    out = run_py(*server["args"], "experiment.runner.deploy.http_server=serve_proxy", "action=bench",
                 *SMALL, timeout=120)
    assert out.returncode == 1 and "experiment.runner.deploy.http_server: running" in out.stderr
    assert run_py(*server["args"], "action=status").returncode == 0  # left alone
