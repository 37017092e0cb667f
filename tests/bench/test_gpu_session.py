"""benchmarks/gpu_session.sh keeps to its budget and returns what it did: each run's limit is
cut to the time left, a run with too little left is skipped and says so, and the summary and
the log archive are written after every run. A stand-in interpreter plays the benchmarks."""
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.sh"
FAKE_PYTHON = """#!/bin/sh
[ "$1" = -c ] && exit 1   # the probes: no xdist, no pytest-timeout, no versions
echo "FlagServe            1.234 ms per token"
echo "args: $*"
"""


def session(tmp_path: Path, budget: int, *runs: str) -> tuple[str, Path]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": str(fake),
           "GPU_SESSION_SECONDS": str(budget)}
    done = subprocess.run(["bash", str(SCRIPT), *runs], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    summary = (out / "summary.txt").read_text()
    assert all(line in done.stdout for line in summary.splitlines())  # the call's output tail
    return summary, out


def test_runs_are_cut_to_the_budget_and_reported(tmp_path):
    summary, out = session(tmp_path, 30, "latency_qwen3", "attention")
    first = next(line for line in summary.splitlines() if line.startswith("latency_qwen3:"))
    limit = int(first.split("(limit ")[1].split(" s")[0])
    assert first.startswith("latency_qwen3: exit 0") and 20 <= limit <= 30  # its own limit is 90
    assert "1.234 ms per token" in summary
    with tarfile.open(out / "logs.tgz") as tar:
        log = tar.extractfile("./latency_qwen3.log").read().decode()
    assert "--shape qwen3-0.6b" in log and "--latency" in log and "--profile 16" in log
    assert "attention: exit 0" in summary


def test_too_little_time_skips_and_unknown_names_are_listed(tmp_path):
    summary, out = session(tmp_path, 10, "nosuch", "tests")
    assert "nosuch: unknown run (one of: latency_qwen3 " in summary
    assert "tests: skipped, " in summary and "s left of 10" in summary
    assert not (out / "logs.tgz").exists()
