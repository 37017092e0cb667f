"""Which live processes a ProcessRecord stands for: its own, and its session's.

Every process FlagServe starts is the leader of a new session (runner/launcher.py), so it and
everything it spawns (the Ray head, raylet, workers, engine processes) share its session id.
"""
from __future__ import annotations

import os

import psutil

from flagserve.cluster.records import ProcessRecord


def live_process(record: ProcessRecord) -> psutil.Process | None:
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def is_alive(record: ProcessRecord) -> bool:
    return live_process(record) is not None


def session_members(record: ProcessRecord) -> list[psutil.Process]:
    """Live processes in the session `record` started (sid == its pid), the leader included."""
    if not record.session:
        proc = live_process(record)
        return [proc] if proc else []
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == record.pid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    leader = live_process(record)
    if leader is None and members:
        if _reused(record):
            # Linux frees a pid only once no process has it as its session id either: another
            # process holding it means the recorded session has no one left (these are the
            # new holder's).
            return []
        # The leader is gone and its pid may have been a new session leader's since: only
        # processes started after the recorded one can belong to the recorded session.
        members = [p for p in members if _safe_create_time(p) >= record.create_time - 1.0]
    return members


def _reused(record: ProcessRecord) -> bool:
    """Whether a process other than the recorded one holds its pid now."""
    try:
        return abs(psutil.Process(record.pid).create_time() - record.create_time) >= 1.0
    except psutil.Error:
        return False


def _safe_create_time(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return 0.0
