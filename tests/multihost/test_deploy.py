"""A real deployment across two hosts (network namespaces with their own sshd, see netns.py):
`run.py ... experiment.runner.hostfile=... action=run` with the tiny model split TP 1 x PP 2
over the hosts, a completion through the OpenAI endpoint equal to the single-process engine,
status per host, stop leaving nothing behind; an unreachable host; a host failing mid-run."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flagserve.cluster.records import ExpPaths, load_processes

REPO = Path(__file__).resolve().parents[2]
PORT = 8000  # each namespace has its own network stack
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 12


def run_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def experiment(netns_hosts, tmp_path: Path, name: str, hostfile: Path, *extra: str) -> list[str]:
    return ["--config-name", "serve", "serve=tiny", f"experiment.exp_name={name}",
            f"experiment.exp_dir={tmp_path / 'exp'}", f"experiment.runner.hostfile={hostfile}",
            f"experiment.runner.ssh.key_file={netns_hosts.client_key}",
            f"experiment.runner.ssh.known_hosts_file={netns_hosts.known_hosts}",
            f"experiment.runner.deploy.port={PORT}", *extra]


def assert_nothing_left(netns_hosts) -> None:
    deadline = time.monotonic() + 10  # sshd's per-connection processes exit on their own
    while True:
        left = {h.address: netns_hosts.foreign_pids(h) for h in netns_hosts.hosts}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(left.values()), f"processes left in the host namespaces: {left}"


def complete(url: str, prompt: str) -> str:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the bridge, directly
    with opener.open(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def test_pipeline_parallel_across_two_hosts(netns_hosts, tmp_path, llama_path):
    head, worker = netns_hosts.hosts
    hostfile = netns_hosts.hostfile(tmp_path / "hostfile")
    args = experiment(netns_hosts, tmp_path, "mh-pp2", hostfile,
                      f"serve.llm.engine_args.model={llama_path}",
                      "serve.llm.engine_args.pipeline_parallel_size=2",
                      "serve.llm.resources.num_cpus=0",  # the shards hold the hosts' CPU slots
                      f"experiment.runner.deploy.host={head.address}",
                      "experiment.runner.deploy.startup_timeout_s=180")
    plan = run_py(*args, "action=plan")
    assert plan.returncode == 0, plan.stderr
    assert f"replica 0 stage 0: {head.address} cpu" in plan.stdout
    assert f"replica 0 stage 1: {worker.address} cpu" in plan.stdout
    exp_dir = tmp_path / "exp"
    try:
        run = run_py(*args, "action=run", timeout=400)
        assert run.returncode == 0, f"run failed:\n{run.stdout}\n{run.stderr}"
        assert f"at http://{head.address}:{PORT}/v1" in run.stdout

        from flagserve import LLM, SamplingParams
        llm = LLM(model=llama_path, device="cpu", dtype="float32")
        expected = [o.outputs[0].text for o in
                    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        got = [complete(f"http://{head.address}:{PORT}", p) for p in PROMPTS]
        assert got == expected

        status = run_py(*args, "action=status", timeout=120)
        assert status.returncode == 0, f"{status.stdout}\n{status.stderr}"
        lines = status.stdout.splitlines()
        for host in (head, worker):
            i = next(i for i, line in enumerate(lines) if line.startswith(f"  host {host.address}"))
            assert "ray node alive" in lines[i] and f"host:{host.address} 1000" in lines[i]
            assert "ShardWorker" in "\n".join(lines[i + 1:i + 5])  # one pipeline stage each
        assert "application RUNNING" in lines[0]
        assert any("llm-engine" in line and "1 running" in line for line in lines)
        # logs of every host under exp_dir, the token in exp_dir (never ~/.ray), 0600
        for host in (head, worker):
            token = exp_dir / "hosts" / host.address / "ray_auth_token"
            assert token.stat().st_mode & 0o777 == 0o600
        assert (exp_dir / "logs" / head.address / "server.log").is_file()
    finally:
        stop = run_py(*args, "action=stop", timeout=300)
    assert stop.returncode == 0, f"{stop.stdout}\n{stop.stderr}"
    for host in (head, worker):
        assert f"  {host.address}: stopped" in stop.stdout
        assert list((exp_dir / "logs" / host.address / "ray").glob("session_*/raylet.out"))
    assert_nothing_left(netns_hosts)
    assert not load_processes(ExpPaths(exp_dir))
    assert not list(exp_dir.glob("hosts/*/ray_auth_token"))  # every host's token too
    again = run_py(*args, "action=stop")
    assert again.returncode == 0 and "nothing to stop" in again.stdout


def test_unreachable_host_is_named_and_nothing_starts(netns_hosts, tmp_path):
    missing = netns_hosts.unused_address()
    hostfile = netns_hosts.hostfile(tmp_path / "hostfile",
                                    extra=[f"{missing} slots=1 type=cpu ssh_port=2222"])
    args = experiment(netns_hosts, tmp_path, "mh-unreachable", hostfile,
                      "experiment.runner.ssh.connect_timeout=3")
    result = run_py(*args, "action=run", timeout=120)
    assert result.returncode in (1, 2), result.stdout
    assert f"host {missing}: cannot connect to SSH at " in result.stderr
    assert not load_processes(ExpPaths(tmp_path / "exp"))
    assert_nothing_left(netns_hosts)


def test_failure_on_one_host_undoes_the_others(netns_hosts, tmp_path):
    head, worker = netns_hosts.hosts
    # cmds.before_start runs on every host; make it fail on the second one only
    fail = f"if ip -4 addr show | grep -q 'inet {worker.address}/'; then echo broken >&2; exit 7; fi"
    args = experiment(netns_hosts, tmp_path, "mh-undo", netns_hosts.hostfile(tmp_path / "hostfile"),
                      f"experiment.cmds.before_start={json.dumps(fail)}")
    result = run_py(*args, "action=run", timeout=300)
    assert result.returncode == 1, result.stdout
    assert f"host {worker.address}: agent spawn failed" in result.stderr
    assert "experiment.cmds.before_start" in result.stderr and "broken" in result.stderr
    assert f"{head.address}: stopped ray-head" in result.stdout  # what had started is undone
    # with the tokens it copied to every host: this run created the exp_dir, it leaves none
    assert not (tmp_path / "exp").exists()
    assert_nothing_left(netns_hosts)

