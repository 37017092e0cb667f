"""Hostfiles in FlagScale's format, and the inventory of this host when there is none.

    # comments and blank lines are fine; the first host is the head
    10.0.0.1 slots=8 type=gpu
    10.0.0.2 slots=8 type=gpu ssh_port=2222 user=ubuntu
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    address: str
    slots: int  # devices of `type` on the host
    type: str = "gpu"  # gpu | cpu | an accelerator name (FlagScale's type=A100): GPUs
    ssh_port: int | None = None
    user: str | None = None

    @property
    def num_gpus(self) -> int:
        return self.slots if self.type != "cpu" else 0


class HostfileError(ValueError):
    """A malformed hostfile line: names the file and the line."""


HOST_KEYS = ("slots", "type", "ssh_port", "user")
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")  # IPv4 or a host name
_IPV4_LIKE = re.compile(r"^[0-9.]+$")  # digits and dots: an IPv4 address, or a mistake
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DIGITS = re.compile(r"[0-9]{1,9}")  # str.isdigit() takes "²", which int() refuses
USAGE = "`IP slots=N [type=gpu|cpu|NAME] [ssh_port=N] [user=NAME]`"


def parse_hostfile(path: str | Path) -> list[Host]:
    """The hosts of a FlagScale hostfile, head first. Errors name the file, line and text."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HostfileError(f"{path}: not UTF-8 text (byte {err.start}): is it a hostfile?") from None
    return parse_hostfile_text(text, str(path))


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        host = _parse_line(body, f"{source}:{lineno}: {line.strip()!r}")
        key = host.address.lower()  # host names are case-insensitive (IPv4 has one spelling)
        if key in seen:
            raise HostfileError(f"{source}:{lineno}: {line.strip()!r}: duplicate host "
                                f"{host.address} (first listed on line {seen[key]})")
        seen[key] = lineno
        hosts.append(host)
    if not hosts:
        raise HostfileError(f"{source}: lists no hosts; expected one per line: {USAGE}")
    return hosts


def _parse_line(body: str, where: str) -> Host:
    address, *fields = body.split()
    _check_address(address, where)
    values: dict[str, str] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or key not in HOST_KEYS or not value:
            raise HostfileError(f"{where}: expected {USAGE}, got {item!r}")
        if key in values:
            raise HostfileError(f"{where}: {key}= given twice")
        values[key] = value
    slots = values.get("slots")
    if slots is None or not DIGITS.fullmatch(slots) or int(slots) < 1:
        raise HostfileError(f"{where}: needs slots=N with N >= 1 (devices of the host)")
    port = values.get("ssh_port")
    if port is not None and not (DIGITS.fullmatch(port) and 1 <= int(port) <= 65535):
        raise HostfileError(f"{where}: ssh_port must be a TCP port (1..65535), got {port!r}")
    for key in ("type", "user"):
        if key in values and not _NAME_RE.match(values[key]):
            raise HostfileError(f"{where}: {key}={values[key]!r} is not a simple name")
    kind = values.get("type", "gpu")
    kind = kind.lower() if kind.lower() in ("gpu", "cpu") else kind  # NAME: e.g. A100, a GPU
    return Host(address, int(slots), kind, int(port) if port else None, values.get("user"))


def _check_address(address: str, where: str) -> None:
    """An IPv4 address (one spelling: no leading zeros, which some tools read as octal) or a
    host name. IPv6 is refused: the Ray nodes' addresses and the shards' torch.distributed
    rendezvous are built as `address:port`, which needs brackets for IPv6 that they lack."""
    if ":" in address or address.startswith("["):
        host, _, port = address.rpartition(":")
        if DIGITS.fullmatch(port) and _ADDRESS_RE.match(host):  # 10.0.0.2:2222, node2:2222
            raise HostfileError(f"{where}: {address!r}: a port does not go in the address; write "
                                f"`{host} ... ssh_port={port}` (the SSH port)")
        raise HostfileError(f"{where}: {address!r}: IPv6 addresses are not supported; use the "
                            "host's IPv4 address or a host name")
    if "=" in address or not _ADDRESS_RE.match(address):
        raise HostfileError(f"{where}: {address!r} is not a host address; expected {USAGE}")
    if _IPV4_LIKE.match(address):
        try:
            ipaddress.IPv4Address(address)
        except ValueError as err:  # 999.1.1.1, 10.0.0, 10.0.0.01
            raise HostfileError(f"{where}: {address!r} is not an IPv4 address ({err})") from None


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
