"""Start processes from argument lists and stop exactly those processes again.

No generated shell scripts and no matching by name: every process is started as the leader
of a new session, so it and everything it spawns (the Ray head, raylet, workers) share its
session id; `stop` signals the leader, then whatever is left in that session.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import psutil

from flagserve.cluster.records import ProcessRecord
from flagserve.cluster.sessions import live_process, session_members

# How long `stop` waits for the serving process after SIGTERM, beyond the drain timeout: the
# replicas' engines stop, then Serve and Ray shut down.
SERVER_STOP_MARGIN_S = 30.0


def server_grace_s(drain_timeout_s: float) -> float:
    return drain_timeout_s + SERVER_STOP_MARGIN_S


def spawn(name: str, argv: list[str], env: dict[str, str], log: Path | None,
          cwd: str | None = None, pass_fds: tuple[int, ...] = ()
          ) -> tuple[subprocess.Popen, ProcessRecord]:
    """Start `argv` in a new session; output goes to `log` (None: inherit the terminal);
    `pass_fds` stay open in the child."""
    # The log is appended to by every run of the experiment: this one's output starts here.
    offset = log.stat().st_size if log is not None and log.exists() else 0
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 - owned by the child
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                pass_fds=pass_fds)
    finally:
        if out is not None:
            out.close()
    record = ProcessRecord(name, proc.pid, psutil.Process(proc.pid).create_time(), argv,
                           str(log) if log else None, log_offset=offset)
    return proc, record


def terminate(record: ProcessRecord, grace_s: float = 30.0) -> list[str]:
    """SIGTERM the leader (it shuts Serve and Ray down), then SIGTERM/SIGKILL what is left.

    Returns descriptions of processes that survived (empty: all gone)."""
    leader = live_process(record)
    if leader is not None:
        _signal(leader, signal.SIGTERM)
        wait_exited([leader], grace_s)
    left = session_members(record)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not left:
            break
        for proc in left:
            _signal(proc, sig)
        wait_exited(left, wait_s)
        left = session_members(record)
    return [f"pid {p.pid} ({_name(p)})" for p in left]


def _signal(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        proc.send_signal(sig)


def wait_exited(procs: list[psutil.Process], timeout: float) -> None:
    """Until every one of `procs` has exited or `timeout` passes. An exited process that is
    not our child stays a zombie until its parent (often init) reaps it, seconds later on some
    machines: exited is enough (psutil's wait() would wait for the reaping)."""
    deadline = time.monotonic() + timeout
    while any(map(_running, procs)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:3]) or proc.name()
    except psutil.Error:
        return "?"
