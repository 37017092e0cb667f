"""Hosts on one machine: network namespaces joined by a bridge, each running its own sshd.

    bridge fsbr<tag> 10.250.X.1/24 (this namespace: the runner's side, like an admin node)
      veth fsv<tag>h0 -> namespace fs-<tag>-h0, eth0 10.250.X.2, sshd on port 2222 (own config, keys)
      veth fsv<tag>h1 -> namespace fs-<tag>-h1, eth0 10.250.X.3, ...

Everything created is recorded and removed by `destroy()` (idempotent, also registered with
atexit): processes inside our namespaces (sshd and whatever a test left), the namespaces, the
veths, the bridge. Only names with this instance's random tag and a subnet nobody on the
machine uses are touched. `ip netns exec` is used here only; the runner under test uses SSH.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_PORT = 2222


def unavailable_reason() -> str | None:
    """Why namespaces + sshd cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    if not shutil.which("ip"):
        return "iproute2 (`ip`) is not installed"
    if not Path(SSHD).is_file():
        return "openssh-server is not installed (.ci/run installs it: apt-get install -y openssh-server)"
    probe = f"fsprobe{os.getpid() % 100000}"
    for what, add, delete in (
            ("network namespaces", ["netns", "add", probe], ["netns", "del", probe]),
            ("bridges", ["link", "add", probe, "type", "bridge"], ["link", "del", probe]),
            ("veth pairs", ["link", "add", probe, "type", "veth", "peer", "name", f"{probe}p"],
             ["link", "del", probe])):
        made = subprocess.run(["ip", *add], capture_output=True, text=True)
        if made.returncode != 0:
            return f"cannot create {what}: {made.stderr.strip()}"
        subprocess.run(["ip", *delete], capture_output=True)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    used += subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for third in random.sample(range(1, 255), 254):
        if f"10.250.{third}." not in used:
            return third
    raise RuntimeError("no free 10.250.x.0/24 subnet")


@dataclass
class NetnsHost:
    namespace: str
    address: str
    veth: str
    sshd: subprocess.Popen | None = None


@dataclass
class NetnsCluster:
    count: int
    workdir: Path
    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    hosts: list[NetnsHost] = field(default_factory=list)
    bridge: str = ""
    subnet: int = 0
    _done: bool = False

    # -- setup ----------------------------------------------------------------------------
    def create(self) -> NetnsCluster:
        atexit.register(self.destroy)
        try:
            self._network()
            self._keys()
            for i, host in enumerate(self.hosts):
                self._start_sshd(i, host)
            for host in self.hosts:
                self._wait_port(host.address, SSH_PORT)
        except BaseException:
            self.destroy()
            raise
        return self

    def _network(self) -> None:
        self.subnet = _free_subnet()
        self.bridge = f"fsbr{self.tag}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.250.{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            host = NetnsHost(f"fs-{self.tag}-h{i}", f"10.250.{self.subnet}.{i + 2}", f"fsv{self.tag}h{i}")
            _ip("netns", "add", host.namespace)
            self.hosts.append(host)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", f"{host.veth}p")
            _ip("link", "set", f"{host.veth}p", "netns", host.namespace)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            # inside, the interface is eth0 on every host, as on real machines
            _ip("-n", host.namespace, "link", "set", f"{host.veth}p", "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def _keys(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.client_key = self.workdir / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.client_key)],
                       check=True)
        (self.workdir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        self.known_hosts = self.workdir / "known_hosts"
        lines = []
        for i, host in enumerate(self.hosts):
            key = self.workdir / f"h{i}" / "ssh_host_ed25519_key"
            key.parent.mkdir()
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
            kind, blob = Path(f"{key}.pub").read_text().split()[:2]
            lines.append(f"[{host.address}]:{SSH_PORT} {kind} {blob}")
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def _start_sshd(self, i: int, host: NetnsHost) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        d = self.workdir / f"h{i}"
        config = d / "sshd_config"
        config.write_text(
            f"Port {SSH_PORT}\nListenAddress {host.address}\n"
            f"HostKey {d / 'ssh_host_ed25519_key'}\nPidFile {d / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
            "Subsystem sftp internal-sftp\nMaxSessions 64\nMaxStartups 64\n")
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, SSHD, "-D", "-e", "-f", str(config)],
            stdout=open(d / "sshd.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_port(self, address: str, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        logs = "\n".join((self.workdir / f"h{i}" / "sshd.log").read_text(errors="replace")
                         for i in range(len(self.hosts)))
        raise RuntimeError(f"sshd on {address}:{port} did not come up\n{logs}")

    # -- what tests use ------------------------------------------------------------------
    def hostfile(self, path: Path, slots: int = 1, extra: list[str] | None = None) -> Path:
        lines = ["# generated by tests/multihost (network namespaces on this machine)"]
        lines += [f"{h.address} slots={slots} type=cpu ssh_port={SSH_PORT}" for h in self.hosts]
        path.write_text("\n".join(lines + (extra or [])) + "\n")
        return path

    def unused_address(self) -> str:
        return f"10.250.{self.subnet}.{200}"

    def pids(self, host: NetnsHost) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def foreign_pids(self, host: NetnsHost) -> dict[int, str]:
        """Processes in the host's namespace other than its sshd and sshd's session children."""
        keep = {host.sshd.pid} if host.sshd else set()
        out = {}
        for pid in self.pids(host):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if pid in keep or cmd.startswith(("sshd", SSHD)):
                continue
            out[pid] = cmd
        return out

    def exec(self, host: NetnsHost, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.namespace, *argv], **kwargs)

    # -- teardown ------------------------------------------------------------------------
    def destroy(self) -> None:
        if self._done:
            return
        self._done = True
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.terminate()
                try:
                    host.sshd.wait(5)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
        for host in self.hosts:  # anything a failed test left inside our namespaces
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = self.pids(host)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while pids and time.monotonic() < deadline:
                    time.sleep(0.2)
                    pids = self.pids(host)
                if not pids:
                    break
        for host in self.hosts:
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
