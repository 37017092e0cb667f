"""Hostfiles in FlagScale's format, and the inventory of this host when there is none.

    # comments and blank lines are fine; the first host is the head
    10.0.0.1 slots=8 type=gpu
    10.0.0.2 slots=8 type=gpu ssh_port=2222 user=ubuntu
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    address: str
    slots: int  # devices of `type` on the host
    type: str = "gpu"  # gpu | cpu | an accelerator name
    ssh_port: int | None = None
    user: str | None = None

    @property
    def num_gpus(self) -> int:
        return self.slots if self.type != "cpu" else 0


class HostfileError(ValueError):
    """A malformed hostfile line: names the file and the line."""


def parse_hostfile(path: str | Path) -> list[Host]:
    hosts: list[Host] = []
    seen: set[str] = set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{lineno}: {line.strip()!r}"
        address, *fields = text.split()
        values: dict[str, str] = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or key not in ("slots", "type", "ssh_port", "user") or not value:
                raise HostfileError(f"{where}: expected `IP slots=N [type=gpu|cpu] [ssh_port=N] "
                                    f"[user=NAME]`, got {item!r}")
            values[key] = value
        if "slots" not in values or not values["slots"].isdigit() or int(values["slots"]) < 1:
            raise HostfileError(f"{where}: needs slots=N with N >= 1")
        if values.get("ssh_port") is not None and not values["ssh_port"].isdigit():
            raise HostfileError(f"{where}: ssh_port must be a number")
        if address in seen:
            raise HostfileError(f"{where}: duplicate host {address}")
        seen.add(address)
        hosts.append(Host(address, int(values["slots"]), values.get("type", "gpu"),
                          int(values["ssh_port"]) if "ssh_port" in values else None,
                          values.get("user")))
    if not hosts:
        raise HostfileError(f"{path}: lists no hosts")
    return hosts


def local_host(envs: dict[str, str] | None = None) -> Host:
    """This machine: its visible GPUs (nvidia-smi, honouring CUDA_VISIBLE_DEVICES) or CPU."""
    n = local_gpu_count(envs)
    return Host("127.0.0.1", n, "gpu") if n else Host("127.0.0.1", os.cpu_count() or 1, "cpu")


def local_gpu_count(envs: dict[str, str] | None = None) -> int:
    visible = (envs or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    smi = shutil.which("nvidia-smi")
    count = 0
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    if visible is not None and str(visible).strip() != "":
        count = min(count, len([d for d in str(visible).split(",") if d.strip()]))
    elif visible is not None:
        count = 0  # CUDA_VISIBLE_DEVICES="" hides every GPU
    return count
