"""What `run` started, written under exp_dir/run/ so that `stop` and `status` find it.

    exp_dir/config.yaml          the resolved config the server was started with (mode 0600:
                                 it holds deploy.api_key; `status` and `stop` read it back)
    exp_dir/logs/<name>.log      one log per process (Ray's own logs: exp_dir/logs/ray ->)
    exp_dir/run/processes.json   ProcessRecord per started process (pid, session, start time)
    exp_dir/run/ray.json         the Ray cluster the server started: GCS address, namespace
    exp_dir/run/ray_auth_token   the cluster's Ray auth token (mode 0600)
    exp_dir/run/hosts.json       multi-host runs: HostRecord per host (how `stop` reaches it)
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class ProcessRecord:
    name: str
    pid: int
    create_time: float  # with pid, identifies the process even if the pid is reused
    argv: list[str]
    log: str | None
    host: str = "localhost"
    session: bool = True  # started as a session leader: its sid (== pid) marks its descendants
    log_offset: int = 0  # the log's size when it started: its own output begins there


@dataclass
class RayRecord:
    gcs_address: str
    namespace: str
    app_name: str
    session_dir: str | None = None
    endpoint: str = ""


@dataclass
class HostRecord:
    """A host of a multi-host run, as `run` reached it (stop and status need no hostfile)."""
    address: str
    user: str
    ssh_port: int
    shared_fs: bool  # exp_dir on the host is this machine's exp_dir (same files): no copying
    head: bool = False


@dataclass
class ExpPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def processes(self) -> Path:
        return self.run / "processes.json"

    @property
    def ray(self) -> Path:
        return self.run / "ray.json"

    @property
    def hosts(self) -> Path:
        return self.run / "hosts.json"

    @property
    def ray_token(self) -> Path:
        return self.run / "ray_auth_token"

    @property
    def stopping(self) -> Path:
        """Present while `stop` runs: a `run` still waiting for its server then knows why it
        ended (and leaves the logs `stop` keeps)."""
        return self.run / "stopping"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def make(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(mode=0o700, parents=True, exist_ok=True)

    def has_records(self) -> bool:
        return self.processes.exists()


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (it holds a secret), also when it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # readers never see half a file


def save_processes(paths: ExpPaths, records: list[ProcessRecord]) -> None:
    _write_json(paths.processes, [asdict(r) for r in records])


def load_processes(paths: ExpPaths) -> list[ProcessRecord]:
    if not paths.processes.exists():
        return []
    return [ProcessRecord(**r) for r in json.loads(paths.processes.read_text())]


def save_ray(paths: ExpPaths, record: RayRecord) -> None:
    _write_json(paths.ray, asdict(record))


def load_ray(paths: ExpPaths) -> RayRecord | None:
    if not paths.ray.exists():
        return None
    return RayRecord(**json.loads(paths.ray.read_text()))


def save_hosts(paths: ExpPaths, records: list[HostRecord]) -> None:
    _write_json(paths.hosts, [asdict(r) for r in records])


def load_hosts(paths: ExpPaths) -> list[HostRecord]:
    if not paths.hosts.exists():
        return []
    return [HostRecord(**r) for r in json.loads(paths.hosts.read_text())]


def clear(paths: ExpPaths) -> None:
    """Forget a run: its records, and its Ray token (the next run gets a fresh one)."""
    for path in (paths.processes, paths.ray, paths.hosts, paths.ray_token):
        path.unlink(missing_ok=True)
