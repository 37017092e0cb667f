"""Which experiment owns a TCP port of this machine: one flock'd file per port.

The engine replicas bind the port with SO_REUSEPORT (README, "The serving graph"), so the
kernel lets a second experiment on the same port bind too and clients would get one model
or the other at random. Ownership is therefore decided here, not by bind(): `run` takes
the port's lock before anything starts and hands the open file to the serving process,
which holds it for its life; the kernel releases it when that process ends, however it
ends. The key is the port alone: with SO_REUSEPORT, 0.0.0.0:P and 127.0.0.1:P collide too.

    $FLAGSERVE_RUN_DIR (default /tmp/flagserve-<uid>, mode 0700)/port-<P>.lock
        its holder's OwnerRecord as JSON (exp_name, exp_dir, endpoint)

The same files tell `status` and `stop` where a running experiment keeps its records.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_DIR_ENV = "FLAGSERVE_RUN_DIR"
TAKE_RETRY_S = 0.5  # owners() holds a probe lock for microseconds: retry that long, no more


@dataclass
class OwnerRecord:
    exp_name: str
    exp_dir: str
    endpoint: str
    port: int


class PortTakenError(Exception):
    def __init__(self, port: int, owner: OwnerRecord | None):
        self.port, self.owner = port, owner
        who = (f"experiment {owner.exp_name} (exp_dir {owner.exp_dir}, {owner.endpoint})"
               if owner else "another FlagServe experiment")
        super().__init__(f"port {port} is owned by {who}")


def run_dir() -> Path:
    """This user's directory of port locks (one per machine: ports are per machine)."""
    path = Path(os.environ.get(RUN_DIR_ENV) or Path(tempfile.gettempdir()) / f"flagserve-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def lock_path(port: int) -> Path:
    return run_dir() / f"port-{port}.lock"


def take_port(owner: OwnerRecord) -> int:
    """Lock owner.port for this process; returns the open fd that holds the lock (pass it to
    the serving process, then close it here). Raises PortTakenError when another holder has it."""
    fd = os.open(lock_path(owner.port), os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + TAKE_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = _read(fd)
                os.close(fd)
                raise PortTakenError(owner.port, holder) from None
            time.sleep(0.02)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(owner)).encode(), 0)
    return fd


def owners() -> list[OwnerRecord]:
    """Every port lock that is held now: the running experiments of this user."""
    held = []
    for path in sorted(run_dir().glob("port-*.lock")):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # got it: nobody holds the port
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                if (record := _read(fd)) is not None:
                    held.append(record)
            finally:
                os.close(fd)
    return held


def _read(fd: int) -> OwnerRecord | None:
    try:
        return OwnerRecord(**json.loads(os.pread(fd, 1 << 16, 0)))
    except (ValueError, TypeError, OSError):
        return None  # being written, or not ours
