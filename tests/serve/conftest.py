"""Fixtures for the serving tests: one real deployment (run.py action=run) shared by the
tests of a module, stopped with action=stop and, should that fail, by its recorded session."""
from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"


def run_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def tiny_serve_args(exp_dir: Path, port: int, *overrides: str) -> list[str]:
    """run.py arguments of a tiny-model experiment of its own (name, folder, port)."""
    return ["--config-name", "serve", "serve=tiny", f"experiment.exp_name=test-{uuid.uuid4().hex[:8]}",
            f"experiment.exp_dir={exp_dir}", f"experiment.runner.deploy.port={port}", *overrides]


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port from bind(0) is one the kernel
    hands out again: a Ray gRPC server starting meanwhile can get it, and since both bind with
    SO_REUSEPORT, the deployment's port then answers HTTP or gRPC at random."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # unseeded: parallel test processes draw different ports
    while True:
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port


@dataclass
class Deployment:
    url: str
    exp_dir: Path
    args: list[str]  # run.py arguments selecting this experiment (no action)
    run_output: str
    path: str  # a key of PATHS

    def run_py(self, action: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return run_py(*self.args, *extra, f"action={action}", timeout=timeout)


def kill_recorded(exp_dir: Path) -> None:
    """Last resort when action=stop failed: end the recorded sessions (our pids only)."""
    from flagserve.cluster.records import ExpPaths, load_processes
    from flagserve.runner.launcher import terminate
    for record in load_processes(ExpPaths(exp_dir)):
        terminate(record, grace_s=5)


# The two ends of the serving path: the default (the ingress in the engine replica, which
# listens on the port itself and runs its engine in a child process) and the classic one
# (Ray Serve's proxy -> a separate ingress deployment -> the engine deployment, whose step
# loop is a thread).
PATHS = {
    "direct": [],
    "proxied": ["experiment.runner.deploy.ingress=separate",
                "experiment.runner.deploy.http_server=serve_proxy", "serve.llm.engine_core=thread"],
}


@pytest.fixture(scope="module", params=list(PATHS))
def deployment(request, tmp_path_factory) -> Deployment:
    exp_dir = tmp_path_factory.mktemp("exp")
    port = free_port()
    args = tiny_serve_args(
        exp_dir, port, f"experiment.runner.deploy.api_key={API_KEY}",
        # CLI overrides under test: renamed model, smaller context and batch.
        "serve.llm.model_name=tiny-test", "serve.llm.engine_args.max_model_len=512",
        "serve.llm.engine_args.max_num_seqs=16",
        # Hooks: each runs once (test_stop_leaves_no_process reads the file).
        f"experiment.cmds.before_start='echo start >> {exp_dir}/hooks'",
        f"experiment.cmds.after_stop='echo stop >> {exp_dir}/hooks'",
        # A user module composed from the command line, preprocessing the LLM's requests.
        "+serve.retriever.module=examples/custom_graph/retriever.py",
        "+serve.retriever.name=Retriever", "serve.llm.depends=[retriever]",
        *PATHS[request.param],
    )
    try:
        result = run_py(*args, "action=run", timeout=600)
        assert result.returncode == 0, f"run failed:\n{result.stdout}\n{result.stderr}"
        yield Deployment(f"http://127.0.0.1:{port}", exp_dir, args, result.stdout, request.param)
    finally:
        stop = run_py(*args, "action=stop", timeout=120)
        if stop.returncode != 0:
            kill_recorded(exp_dir)
