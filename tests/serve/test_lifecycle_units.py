"""The pieces of run/stop/status that need no deployment: port ownership, finding a run by
its records, the hints a user copies, the drain of one replica's HTTP, the engine process's
liveness."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys

import pytest
import yaml

from flagserve.cluster.port_owner import RUN_DIR_ENV, OwnerRecord, PortTakenError, owners, take_port
from flagserve.cluster.records import ExpPaths, write_private
from flagserve.config import parse_config
from flagserve.entrypoints.openai.drain import Drain
from flagserve.runner import console
from flagserve.runner.locate import recorded_config


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_a_port_has_one_owner_until_its_holder_closes_it(run_dir):
    first = OwnerRecord("a", "/x/a", "http://127.0.0.1:9001", 9001)
    fd = take_port(first)
    with pytest.raises(PortTakenError, match=r"port 9001 is owned by experiment a \(exp_dir /x/a"):
        take_port(OwnerRecord("b", "/x/b", "http://0.0.0.0:9001", 9001))
    assert owners() == [first]
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    os.close(fd)  # what the kernel does when the serving process ends, however it ends
    assert owners() == []
    os.close(take_port(OwnerRecord("b", "/x/b", "http://0.0.0.0:9001", 9001)))


@pytest.mark.usefixtures("run_dir")
def test_status_and_stop_read_the_run_from_its_records(tmp_path):
    exp_dir = tmp_path / "exp"
    started, _ = parse_config({"experiment": {"exp_name": "demo", "exp_dir": str(exp_dir), "runner": {
        "deploy": {"port": 9123, "api_key": "k"}}}})
    paths = ExpPaths(exp_dir)
    paths.make()
    paths.processes.write_text("[]")
    write_private(paths.config, yaml.safe_dump(dataclasses.asdict(started)).encode())
    assert oct(paths.config.stat().st_mode & 0o777) == "0o600"
    # the same exp_dir, nothing else: the recorded port and key
    bare, _ = parse_config({"action": "status", "experiment": {"exp_dir": str(exp_dir)}})
    found = recorded_config(bare)
    assert (found.deploy.port, found.api_key, found.action) == (9123, "k", "status")
    # only the name: found through the port lock its serving process holds
    fd = take_port(OwnerRecord("demo", str(exp_dir), "http://127.0.0.1:9123", 9123))
    try:
        named, _ = parse_config({"action": "stop", "experiment": {
            "exp_name": "demo", "exp_dir": str(tmp_path / "elsewhere")}})
        assert recorded_config(named, ["experiment.exp_name=demo"]).deploy.port == 9123
        # an exp_dir the command line names is the run meant: never another run in its place
        given = [f"experiment.exp_dir={tmp_path / 'elsewhere'}"]
        assert recorded_config(named, given) is named
        assert recorded_config(named, ["+" + given[0]]) is named
    finally:
        os.close(fd)


def test_hints_use_the_venv_python_and_leave_the_other_overrides_out(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv/bin/python"))
    monkeypatch.setattr(sys, "argv", ["run.py", "--config-path", "examples/x", "--config-name",
                                      "serve", "experiment.exp_name=a", "+experiment.exp_dir=/d",
                                      "experiment.runner.deploy.api_key=secret",
                                      "experiment.runner.deploy.port=9", "action=run"])
    assert console.same_command("stop") == (".venv/bin/python run.py --config-path examples/x "
                                            "--config-name serve experiment.exp_name=a "
                                            "experiment.exp_dir=/d action=stop")


SSE = [(b"content-type", b"text/event-stream")]


async def streaming_app(_scope, _receive, send, events: int = 1000, every_s: float = 0.02):
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    for i in range(events):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(),
                    "more_body": True})
        await asyncio.sleep(every_s)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def call(app, path: str = "/v1/completions") -> tuple[int, bytes]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "path": path}, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_drain_lets_short_requests_finish_and_ends_long_streams_with_error_and_done():
    async def main():
        short = Drain(lambda s, r, c: streaming_app(s, r, c, events=5))
        task = asyncio.create_task(call(short))
        await asyncio.sleep(0.01)
        assert await short.run(timeout_s=5.0) == (1, 0)
        status, body = await task
        assert status == 200 and body.endswith(b"data: 4\n\ndata: [DONE]\n\n")
        assert await call(short) == (503, json.dumps({"error": {
            "message": "the server is shutting down; retry on another replica or after it restarts",
            "type": "ServiceUnavailableError", "param": None, "code": 503}}).encode())

        long = Drain(streaming_app)
        task = asyncio.create_task(call(long))
        await asyncio.sleep(0.05)
        assert await long.run(timeout_s=0.2) == (1, 1)
        status, body = await task
        error, done = body.rstrip(b"\n").split(b"\n\n")[-2:]
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == 503
        assert done == b"data: [DONE]"
    asyncio.run(main())


def test_an_engine_process_is_dead_for_health_the_moment_it_is_killed():
    from flagserve.engine.core.process import EngineProcess
    from flagserve.engine.engine_args import EngineArgs
    from flagserve.models.tiny import default_model_dir, ensure_tiny_model
    path = default_model_dir("llama")
    ensure_tiny_model(path, "llama")
    core = EngineProcess(EngineArgs(model=str(path), device="cpu", dtype="float32",
                                    max_model_len=128, cpu_kv_cache_space_gib=0.05))
    try:
        core.start(lambda _result: None)
        assert core.alive
        os.kill(core.proc.pid, signal.SIGKILL)
        assert not core.alive  # at once: not when the reader thread sees the socket close
    finally:
        core.shutdown()


def test_stop_counts_an_exited_process_no_one_has_reaped_as_gone():
    """What `stop` waits for is not its child: an exited one stays a zombie until its parent
    reaps it (init, seconds later on some machines). Exited is enough."""
    import subprocess
    import time

    import psutil

    from flagserve.runner.launcher import wait_exited
    never_reaps = ("import subprocess, sys, time\n"
                   "child = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
                   "print(child.pid, flush=True)\n"
                   "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", never_reaps], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        started = time.monotonic()
        wait_exited([child], timeout=30)
        assert time.monotonic() - started < 15
        assert child.status() == psutil.STATUS_ZOMBIE  # still unreaped: the wait did not need it
    finally:
        parent.kill()
        parent.wait()


def test_a_reused_pid_and_its_session_are_not_the_recorded_ones():
    """Records of a run long gone (a reboot, a crash) whose leader's pid another session
    leader holds now: stop must not take that session for the recorded one."""
    import subprocess

    import psutil

    from flagserve.cluster.records import ProcessRecord
    from flagserve.cluster.sessions import session_members
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = psutil.Process(other.pid).create_time()
        stale = ProcessRecord("server", other.pid, started - 100, ["sleep"], None)
        assert session_members(stale) == []
        own = dataclasses.replace(stale, create_time=started)
        assert [p.pid for p in session_members(own)] == [other.pid]
    finally:
        other.kill()
        other.wait()


def test_a_failed_start_shows_the_logs_first_errors_before_its_tail(tmp_path):
    """The cause of a failed start sits mid-log (a worker's traceback, behind Ray's colours
    and prefix); the tail holds what failed after it."""
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "starting Ray",
        "\x1b[36m(ServeController pid=28118)\x1b[0m RuntimeError: Traceback (most recent call last):",
        "\x1b[36m(ServeController pid=28118)\x1b[0m safetensors._rust.SafetensorError: invalid header length",
        *[f"noise {i}" for i in range(50)],
        "RuntimeError: Deploying application x failed"]))
    text = console.tail(log, 3)
    assert text.splitlines()[:3] == [
        "first errors in the log:", "  safetensors._rust.SafetensorError: invalid header length",
        "  RuntimeError: Deploying application x failed"]
    assert text.splitlines()[-1] == "RuntimeError: Deploying application x failed"


def test_a_failed_start_reads_only_its_own_part_of_the_log(tmp_path):
    """The log is appended to by every run of the experiment: an earlier run's errors are not
    this start's "first errors"; spawn records where this run's output begins."""
    from flagserve.runner.launcher import spawn
    log = tmp_path / "server.log"
    log.write_text("ValueError: rejected by policy (a request of the last run)\n")
    proc, record = spawn("server", [sys.executable, "-c", "raise TypeError('bad init arg')"],
                         dict(os.environ), log)
    proc.wait()
    assert record.log_offset == len("ValueError: rejected by policy (a request of the last run)\n")
    text = console.tail(log, 3, record.log_offset)
    assert "first errors in the log:\n  TypeError: bad init arg" in text
    assert "rejected by policy" not in text


@pytest.mark.parametrize("host,words", [("notahost.invalid", "does not resolve"),
                                        ("192.0.2.1", "is not an address of this machine")])
def test_a_bad_deploy_host_is_named_not_taken_for_a_port_in_use(host, words):
    from types import SimpleNamespace

    from flagserve.config.errors import ConfigError
    from flagserve.runner.local import _check_port_free
    with pytest.raises(ConfigError) as err:
        _check_port_free(SimpleNamespace(deploy=SimpleNamespace(host=host, port=41997)))
    assert err.value.key == "experiment.runner.deploy.host" and words in str(err.value)


@pytest.mark.usefixtures("run_dir")
def test_a_stop_while_run_waits_is_reported_as_such_and_keeps_the_logs(tmp_path, monkeypatch,
                                                                      capsys):
    """`run` waiting for /health and a `stop` in another shell: run says it was stopped, and
    does not delete the exp_dir (the logs `stop` keeps) as it does after a failed start."""
    import socket
    import threading
    import time

    from flagserve.runner import local
    from flagserve.runner.launcher import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config, _ = parse_config({"experiment": {"exp_name": "race", "exp_dir": str(tmp_path / "exp"),
                                             "runner": {"deploy": {"port": port}}}})

    def fake_spawn(self, _lock):  # a server that never answers /health
        log = self.paths.log("server")
        proc, record = spawn("server", [sys.executable, "-c", "import time; time.sleep(60)"],
                             dict(os.environ), log)
        self.progress = console.Progress(log)
        local.save_processes(self.paths, [record])
        return proc, record, log

    monkeypatch.setattr(local.LocalDeployment, "_spawn", fake_spawn)
    stopped = []

    def stop_when_recorded():
        paths = ExpPaths(tmp_path / "exp")
        while not paths.has_records():
            time.sleep(0.05)
        stopped.append(local.LocalDeployment(config, []).stop())

    stopper = threading.Thread(target=stop_when_recorded)
    stopper.start()
    try:
        assert local.LocalDeployment(config, []).run(hints=False) == 1
    finally:
        stopper.join(timeout=60)
    assert stopped == [0]
    assert "was stopped (action=stop) before it became healthy" in capsys.readouterr().err
    assert (tmp_path / "exp" / "logs" / "server.log").exists()
    assert not ExpPaths(tmp_path / "exp").stopping.exists()
