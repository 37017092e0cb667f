"""An experiment's life with one real server (issue 12): two runs started at once on one
port (one wins), what listens where, where the API key is written, status and stop without
the run's overrides, and a stop that drains open streams. Tests run in file order; the last
one stops the server."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from flagserve.cluster.port_owner import owners
from flagserve.cluster.ray_env import LOCAL_HOST, SERVE_ENV, ray_temp_dir
from flagserve.cluster.records import ExpPaths, load_processes
from flagserve.runner.launcher import session_members
from tests.serve.conftest import REPO, free_port, kill_recorded, run_py

KEY = f"key-{uuid.uuid4().hex}"  # distinctive: found in a file only where it was written
DRAIN_S = 6.0
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@dataclass
class Race:
    port: int
    args: list[list[str]]  # run.py arguments of each experiment (no action)
    exp_dirs: list[Path]
    results: list[tuple[int, str, str]]  # (exit code, stdout, stderr) of each `run`

    @property
    def winner(self) -> int:
        return next(i for i, r in enumerate(self.results) if r[0] == 0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def exp_dir(self) -> Path:
        return self.exp_dirs[self.winner]

    def run_py(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return run_py(*args, timeout=timeout)


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    port = free_port()
    exp_dirs = [tmp_path_factory.mktemp(f"race{i}") / "exp" for i in range(2)]
    args = [["--config-name", "serve", "serve=tiny",
             f"experiment.exp_name=race-{i}-{uuid.uuid4().hex[:6]}",
             f"experiment.exp_dir={d}", f"experiment.runner.deploy.port={port}",
             f"experiment.runner.deploy.api_key={KEY}",
             f"experiment.runner.deploy.drain_timeout_s={DRAIN_S}"] for i, d in enumerate(exp_dirs)]
    procs = [subprocess.Popen([sys.executable, "run.py", *a, "action=run"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in args]
    try:
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            results.append((proc.returncode, out, err))
        yield Race(port, args, exp_dirs, results)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for a, exp_dir in zip(args, exp_dirs):
            if run_py(*a, "action=stop", timeout=180).returncode != 0:
                kill_recorded(exp_dir)


def test_two_runs_on_one_port_exactly_one_wins(race):
    codes = sorted(r[0] for r in race.results)
    assert codes == [0, 1], race.results
    loser = 1 - race.winner
    name = race.args[race.winner][3].split("=", 1)[1]
    assert (f"cannot start: port {race.port} is owned by experiment {name} "
            f"(exp_dir {race.exp_dir}") in race.results[loser][2]
    assert not race.exp_dirs[loser].exists()  # a failed run leaves no exp_dir behind
    assert requests.get(f"{race.url}/health", timeout=10).status_code == 200


def _listeners(exp_dir: Path) -> list[tuple[str, int, psutil.Process]]:
    found = []
    for proc in session_members(load_processes(ExpPaths(exp_dir))[0]):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            found += [(c.laddr.ip, c.laddr.port, proc) for c in proc.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
    return found


def _outside_address() -> str:
    """An address of this machine other than loopback (what the network reaches)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return "127.0.0.1"


def test_ray_listens_on_loopback_only(race):
    import grpc
    listeners = _listeners(race.exp_dir)
    assert ("127.0.0.1", race.port) in {(ip, port) for ip, port, _ in listeners}
    assert sum(ip in LOOPBACK for ip, _, _ in listeners) >= 5  # GCS, raylet, agents, ...
    outside = _outside_address()
    for ip, port, proc in listeners:
        if ip in LOOPBACK:
            continue
        # Ray Serve binds each replica's gRPC server (calls between deployments) to every
        # interface: it must answer nobody without the cluster's token.
        assert proc.cmdline()[0].startswith("ray::ServeReplica"), (ip, port, proc.cmdline())
        call = grpc.insecure_channel(f"{outside}:{port}").unary_unary(
            "/ray.serve.ASGIService/HandleRequest")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_ray_process_runs_with_the_serving_settings(race):
    # Ray reads them when each of its processes starts (the GCS's controller-loop load and
    # metrics, the raylet's task events, Serve's loop in the controller): all must inherit them.
    names = {"gcs_server": 0, "raylet": 0, "ServeController": 0, "ServeReplica": 0}
    for proc in session_members(load_processes(ExpPaths(race.exp_dir))[0]):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            line = " ".join(proc.cmdline())
            name = next((n for n in names if n in line), None)
            if name is None:
                continue
            names[name] += 1
            env = proc.environ()
            assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, (name, proc.pid)
    assert all(names.values()), names


def test_server_log_has_the_replicas_lines_but_no_metrics_calls(race):
    """The metrics deployment's calls (pushes, scrapes) are not access-logged: they came every
    10 s idle. The replicas' own lines still reach server.log (Ray forwards them)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(f"{race.url}/metrics", headers=auth, timeout=10).status_code == 200
    log = race.exp_dir / "logs" / "server.log"
    deadline = time.monotonic() + 30
    while "engine-core INFO" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    text = log.read_text()
    assert "engine-core INFO" in text  # forwarded replica output
    assert not re.search(r"ServeReplica:[^:]+:metrics .* CALL ", text), text[-2000:]


def test_the_api_key_is_in_no_file_others_can_read(race):
    paths = ExpPaths(race.exp_dir)
    assert oct(paths.config.stat().st_mode & 0o777) == "0o600"
    assert oct(paths.run.stat().st_mode & 0o777) == "0o700"
    holders = []
    for root in (race.exp_dir, Path(ray_temp_dir(str(race.exp_dir), LOCAL_HOST))):
        for file in (f for f in root.rglob("*") if f.is_file() and not f.is_symlink()):
            try:
                if KEY.encode() in file.read_bytes():
                    holders.append(file)
                    assert file.stat().st_mode & 0o077 == 0, file
            except OSError:
                pass  # a socket, or gone meanwhile
    assert holders == [paths.config]


def test_status_and_stop_find_the_run_without_its_overrides(race):
    winner = race.args[race.winner]
    name = winner[3].split("=", 1)[1]
    for args in (winner, ["--config-name", "serve", f"experiment.exp_dir={race.exp_dir}"],
                 [f"experiment.exp_name={name}", "experiment.runner.deploy.port=1"]):
        result = race.run_py(*args, "action=status")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{name}: healthy at {race.url}" in result.stdout
        assert "model tiny-llama" in result.stdout  # asked with the recorded API key
        assert "Traceback" not in result.stderr
    other = f"nobody-{uuid.uuid4().hex[:6]}"
    result = race.run_py(f"experiment.exp_name={other}", "action=stop")
    assert result.returncode == 0 and f"{other}: nothing to stop" in result.stdout
    assert f"running here: {name} at {race.url} (exp_dir {race.exp_dir})" in result.stdout
    assert requests.get(f"{race.url}/health", timeout=10).status_code == 200


def test_run_again_with_the_same_config_succeeds(race):
    result = race.run_py(*race.args[race.winner], "action=run")
    assert result.returncode == 0, result.stderr
    assert "is already running (the same config)" in result.stdout


def _stream(url: str, body: dict, out: dict, name: str) -> None:
    r = requests.post(f"{url}/v1/completions", stream=True, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny-llama", "prompt": "Hi", "stream": True,
                            "ignore_eos": True, **body})
    events = [line.removeprefix(b"data: ") for line in r.iter_lines() if line]
    out[name] = (time.monotonic(), events)


def test_stop_drains_open_streams(race):
    streams: dict = {}
    threads = [threading.Thread(target=_stream, args=(race.url, body, streams, name)) for name, body in
               (("short", {"max_tokens": 300}), ("long", {"max_tokens": 2000, "n": 60, "logprobs": 5}))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    stop = subprocess.Popen([sys.executable, "run.py", f"experiment.exp_dir={race.exp_dir}",
                             "action=stop"], cwd=REPO, text=True, stdout=subprocess.PIPE)
    try:
        draining = None
        while draining is None and time.monotonic() - start < 60:
            if requests.get(f"{race.url}/health", timeout=10).status_code == 503:
                draining = time.monotonic()  # the drain has begun: nothing new gets in
            time.sleep(0.05)
        refused = requests.post(f"{race.url}/v1/completions", timeout=10, json={"model": "x"})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(timeout=120)
        out, _ = stop.communicate(timeout=180)
    finally:
        if stop.poll() is None:
            stop.kill()
    assert stop.returncode == 0 and "no process left" in out, out
    short_end, short = streams["short"]
    assert short[-1] == b"[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    long_end, long = streams["long"]
    assert long[-1] == b"[DONE]", long[-3:]
    assert json.loads(long[-2])["error"]["code"] == 503  # the drain timeout ended it
    assert DRAIN_S - 1 <= long_end - draining <= DRAIN_S + 4, (long_end - draining)
    print(f"drain began {draining - start:.1f} s after stop; the long stream ended "
          f"{long_end - draining:.1f} s later; stop took {time.monotonic() - start:.1f} s")
    # stop removed the run's Ray temp dir (its logs kept under exp_dir) and freed the port
    assert not Path(ray_temp_dir(str(race.exp_dir), LOCAL_HOST)).exists()
    assert (race.exp_dir / "logs/ray").is_dir() and not (race.exp_dir / "logs/ray").is_symlink()
    assert any((race.exp_dir / "logs/ray").glob("session_*/raylet.out"))
    assert race.port not in {o.port for o in owners()}
