"""Multi-host run and stop with SSH faked: every host is this machine (one filesystem), the
agent's verbs run in this process. What a second `run`, a failed `run` and `stop` leave."""
from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from flagserve.cluster.records import (
    HostRecord,
    load_processes,
    save_hosts,
    save_processes,
)
from flagserve.config import parse_config
from flagserve.config.hostfile import parse_hostfile_text
from flagserve.config.schema import Config
from flagserve.runner import agent
from flagserve.runner import host_commands as cmd
from flagserve.runner.launcher import spawn, terminate
from flagserve.runner.local import LocalDeployment
from flagserve.runner.locate import recorded_config
from flagserve.runner.multihost import MultiHostDeployment
from flagserve.runner.ssh import Connection, HostError, Result

HOSTS = parse_hostfile_text("10.0.0.1 slots=1 type=cpu\n10.0.0.2 slots=1 type=cpu\n")
HEAD, WORKER = (h.address for h in HOSTS)


def config(exp_dir: Path, port: int = 8123, pp: int = 2):
    cfg, _ = parse_config({
        "experiment": {"exp_name": "demo", "exp_dir": str(exp_dir),
                       "runner": {"hostfile": "h.txt", "deploy": {"port": port}}},
        "serve": {"llm": {"engine_args": {"model": "/m", "device": "cpu",
                                          "pipeline_parallel_size": pp}}}})
    return cfg


def fake_ssh(monkeypatch, unreachable: tuple[str, ...] = (), failing: tuple[str, ...] = (),
             answers: dict[str, dict] | None = None):
    """Connection on this machine; returns the (address, agent verb) calls. `unreachable`
    hosts fail to connect, `failing` verbs exit 1, `answers` verbs print that JSON only."""
    calls: list[tuple[str, str]] = []

    def connect(conn):
        if conn.address in unreachable:
            raise HostError(conn.address, "cannot connect to SSH (fake)")
        return conn

    def run(conn, argv, timeout=120.0):  # noqa: ARG001
        args = argv[argv.index("flagserve.runner.agent") + 1:]
        calls.append((conn.address, args[0]))
        if args[0] in failing:
            return Result(1, "", f"{args[0]} failed (fake)")
        if args[0] in (answers or {}):
            return Result(0, json.dumps(answers[args[0]]), "")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = agent.main(args)
        return Result(rc, out.getvalue(), "")

    def put_bytes(conn, data, path, mode=0o644):  # noqa: ARG001
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        os.chmod(path, mode)

    monkeypatch.setattr(Connection, "connect", connect)
    monkeypatch.setattr(Connection, "run", run)
    monkeypatch.setattr(Connection, "put_bytes", put_bytes)
    def makedirs(conn, path, mode=0o755):  # noqa: ARG001
        Path(path).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(Connection, "makedirs", makedirs)
    monkeypatch.setattr(Connection, "close", lambda _conn: None)
    return calls


def tokens(exp_dir: Path) -> list[Path]:
    return sorted(exp_dir.glob("hosts/*/ray_auth_token"))


def test_run_again_with_the_same_config_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    """It exited 1 ("records of a running deployment ... stop it first"), and the stage hosts
    `run` pins into the saved config must not make the same config look different."""
    never_signalled = {"name": "x", "pid": 2**22 + 1, "create_time": 0.0, "argv": [], "log": None}
    fake_ssh(monkeypatch, answers={"spawn": never_signalled, "wait-healthy": {"healthy": True}})
    assert MultiHostDeployment(config(tmp_path), HOSTS).run(hints=False) == 0
    capsys.readouterr()
    assert MultiHostDeployment(config(tmp_path), HOSTS).run(hints=False) == 0
    out, _ = capsys.readouterr()
    assert "demo is already running (the same config)" in out
    assert f"at http://127.0.0.1:8123/v1 across 2 hosts ({HEAD}, {WORKER}" in out
    assert MultiHostDeployment(config(tmp_path, port=8124), HOSTS).run(hints=False) == 1
    _, err = capsys.readouterr()
    assert "demo is already running with another config" in err and "action=stop" in err


def test_an_unreachable_host_leaves_no_exp_dir(tmp_path, monkeypatch, capsys):
    exp = tmp_path / "exp"
    calls = fake_ssh(monkeypatch, unreachable=(WORKER,))
    assert MultiHostDeployment(config(exp), HOSTS).run() == 1
    assert "host 10.0.0.2: cannot connect to SSH (fake)" in capsys.readouterr().err
    assert not exp.exists() and calls == []


def test_a_failed_start_removes_the_tokens_and_the_exp_dir_it_created(tmp_path, monkeypatch):
    """The head's Ray node fails to start once every host has the token: undone on every host
    through the agent's stop verb, which removes the host's token; then the exp_dir goes."""
    exp = tmp_path / "exp"
    calls = fake_ssh(monkeypatch, failing=("spawn",))
    assert MultiHostDeployment(config(exp), HOSTS).run() == 1
    assert calls == [(HEAD, "spawn"), (WORKER, "stop"), (HEAD, "stop")]
    assert not exp.exists()


def test_a_failed_run_in_an_existing_exp_dir_keeps_its_logs_only(tmp_path, monkeypatch):
    exp = tmp_path / "exp"
    (exp / "logs").mkdir(parents=True)
    (exp / "logs" / "earlier.log").write_text("a run before\n")
    fake_ssh(monkeypatch, failing=("spawn",))
    deployment = MultiHostDeployment(config(exp), HOSTS)
    assert deployment.run() == 1
    assert (exp / "logs" / "earlier.log").read_text() == "a run before\n"
    assert tokens(exp) == [] and not (exp / "hosts").exists()
    assert not deployment.paths.ray_token.exists() and not deployment.paths.has_records()


def test_stop_removes_every_hosts_token(tmp_path, monkeypatch):
    """They outlived stop (records.clear removes the local run/ray_auth_token only)."""
    calls = fake_ssh(monkeypatch)
    deployment = MultiHostDeployment(config(tmp_path), HOSTS)
    paths = deployment.paths
    paths.make()
    deployment.save_config()
    save_hosts(paths, [HostRecord(HEAD, "u", 22, True, True), HostRecord(WORKER, "u", 22, True)])
    for address in (HEAD, WORKER):
        host = cmd.HostPaths(str(tmp_path), address)
        Path(host.dir).mkdir(parents=True)
        Path(host.token).write_bytes(b"secret")
    Path(cmd.HostPaths(str(tmp_path), HEAD).cluster).write_text("{}")
    proc, record = spawn("ray-head", ["sleep", "60"], dict(os.environ), None)
    record.host = HEAD
    try:
        save_processes(paths, [record])
        assert deployment.stop() == 0
    finally:
        terminate(record, grace_s=1.0)
        proc.wait()
    assert calls == [(WORKER, "stop"), (HEAD, "stop")]
    assert tokens(tmp_path) == [] and not (tmp_path / "hosts").exists()
    assert load_processes(paths) == [] and not paths.ray_token.exists()


@pytest.mark.parametrize("others", [False, True])
def test_the_agent_keeps_a_shared_hosts_dir_of_other_hosts(tmp_path, others):
    paths = cmd.HostPaths(str(tmp_path), HEAD)
    Path(paths.dir).mkdir(parents=True)
    Path(paths.token).write_bytes(b"secret")
    other = cmd.HostPaths(str(tmp_path), WORKER)
    if others:
        Path(other.dir).mkdir(parents=True)
        Path(other.token).write_bytes(b"secret")
    with contextlib.redirect_stdout(io.StringIO()):
        assert agent.main(["stop", "--records=[]", *(f"--remove={p}" for p in paths.run_files)]) == 0
    assert not Path(paths.dir).exists()
    assert (tmp_path / "hosts").exists() == others
    assert Path(other.token).exists() == others


@contextlib.contextmanager
def recorded_demo(tmp_path: Path) -> Iterator[Config]:
    """A local run of experiment `demo` as its records show it: its config saved, a live
    process recorded."""
    cfg, _ = parse_config({"experiment": {"exp_name": "demo", "exp_dir": str(tmp_path)}})
    local = LocalDeployment(cfg, [])
    local.paths.make()
    local.save_config()
    proc, record = spawn("server", ["sleep", "60"], dict(os.environ), None)
    try:
        save_processes(local.paths, [record])
        yield cfg
    finally:
        terminate(record, grace_s=1.0)
        proc.wait()


def test_the_local_runner_shares_the_same_config_check(tmp_path, capsys):
    """Deployment.already_running, moved from the local runner: a live recorded process."""
    with recorded_demo(tmp_path) as cfg:
        assert LocalDeployment(cfg, []).run(hints=False) == 0
        assert "demo is already running (the same config)" in capsys.readouterr().out
        other, _ = parse_config({"experiment": {"exp_name": "demo", "exp_dir": str(tmp_path),
                                                "runner": {"deploy": {"port": 8124}}}})
        assert LocalDeployment(other, []).run(hints=False) == 1
        assert "already running with another config" in capsys.readouterr().err


def test_an_api_key_from_the_environment_is_recorded(tmp_path, monkeypatch, capsys):
    """`status` from a shell without $FLAGSERVE_API_KEY reads the key the run was started
    with; `run` again with the same key in the environment is the same config."""
    monkeypatch.setenv("FLAGSERVE_API_KEY", "from-env")
    with recorded_demo(tmp_path) as cfg:
        assert LocalDeployment(cfg, []).run(hints=False) == 0
        assert "the same config" in capsys.readouterr().out
        monkeypatch.delenv("FLAGSERVE_API_KEY")
        bare, _ = parse_config({"action": "status", "experiment": {"exp_dir": str(tmp_path)}})
        assert recorded_config(bare, []).api_key == "from-env"
