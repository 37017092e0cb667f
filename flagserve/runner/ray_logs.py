"""Ray's temp dir of a run (its sessions: sockets, spilled objects, logs) is removed by `stop`,
on every host; its text logs are kept under exp_dir first."""
from __future__ import annotations

import shutil
from pathlib import Path

LOG_SUFFIXES = (".log", ".out", ".err", ".txt")
MAX_LOG_BYTES = 64 * 2**20  # per file copied from Ray's session logs


def remove_ray_temp_dir(temp_dir: Path, logs: Path | None) -> None:
    """Copy the session logs of `temp_dir` to `logs` (None: keep nothing), then remove it."""
    if not temp_dir.is_dir():
        return
    if logs is not None:
        if logs.is_symlink():  # the run's link into the session, which goes away now
            logs.unlink()
        keep_ray_logs(temp_dir, logs)
    shutil.rmtree(temp_dir, ignore_errors=True)


def keep_ray_logs(temp_dir: Path, dest: Path) -> None:
    """Copy the session logs of Ray's temp dir (text logs only) before it is removed."""
    for session in sorted(temp_dir.glob("session_2*")):
        for file in (session / "logs").rglob("*"):
            if file.is_file() and file.suffix in LOG_SUFFIXES and not file.is_symlink():
                target = dest / session.name / file.relative_to(session / "logs")
                target.parent.mkdir(parents=True, exist_ok=True)
                with file.open("rb") as src, target.open("wb") as out:
                    shutil.copyfileobj(src, out, length=2**20)
                    if file.stat().st_size > MAX_LOG_BYTES:
                        out.truncate(MAX_LOG_BYTES)
