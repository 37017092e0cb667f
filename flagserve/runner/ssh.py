"""SSH to the hosts of a hostfile with paramiko: key authentication, a known-hosts policy,
commands sent as quoted argument lists, files over SFTP.

    experiment.runner.ssh: {user, key_file, known_hosts: strict|auto_add|ignore,
                            known_hosts_file, connect_timeout}
"""
from __future__ import annotations

import getpass
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import paramiko

from flagserve.cluster.records import HostRecord
from flagserve.config.hostfile import Host
from flagserve.config.schema import RunnerConfig
from flagserve.runner.host_commands import command_line

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
SSH_MARGIN_S = 60.0  # an agent verb's SSH timeout: on top of the one the agent enforces


class HostError(Exception):
    """Something failed on one host; the message starts with the host."""

    def __init__(self, address: str, message: str):
        super().__init__(f"host {address}: {message}")
        self.address = address


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


class _AcceptPolicy(paramiko.MissingHostKeyPolicy):
    """known_hosts: ignore -- accept any host key without recording it."""

    def missing_host_key(self, client, hostname, key):  # noqa: ARG002
        return


def ssh_target(host: Host, runner: RunnerConfig) -> tuple[str, int]:
    """(user, port) of a host: the hostfile's user=/ssh_port= win over the config."""
    user = host.user or runner.ssh.user or getpass.getuser()
    return user, host.ssh_port or runner.ssh_port


class Connection:
    """One SSH connection to one host, for the duration of one runner action."""

    def __init__(self, host: Host, runner: RunnerConfig):
        self.host = host
        self.address = host.address
        self.user, self.port = ssh_target(host, runner)
        self.ssh = runner.ssh
        self.client = paramiko.SSHClient()
        self._sftp: paramiko.SFTPClient | None = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def where(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"

    def connect(self) -> Connection:
        ssh = self.ssh
        known = Path(os.path.expanduser(ssh.known_hosts_file or DEFAULT_KNOWN_HOSTS))
        if ssh.known_hosts == "ignore":
            self.client.set_missing_host_key_policy(_AcceptPolicy())
        else:
            if ssh.known_hosts_file is None:
                self.client.load_system_host_keys()
            if known.is_file():
                self.client.load_host_keys(str(known))
            self.client.set_missing_host_key_policy(
                paramiko.AutoAddPolicy() if ssh.known_hosts == "auto_add" else paramiko.RejectPolicy())
        try:
            self.client.connect(
                self.address, port=self.port, username=self.user, key_filename=ssh.key_file,
                timeout=ssh.connect_timeout, banner_timeout=ssh.connect_timeout,
                auth_timeout=ssh.connect_timeout, allow_agent=ssh.key_file is None,
                look_for_keys=ssh.key_file is None)
        except paramiko.BadHostKeyException as err:
            raise HostError(self.address, f"its host key does not match {known} "
                            f"({err.key.get_name()}); if the host was reinstalled, remove its "
                            "old entry") from None
        except paramiko.AuthenticationException as err:
            raise HostError(self.address, f"SSH key authentication as {self.user!r} failed "
                            f"({err}); set experiment.runner.ssh.key_file or user=") from None
        except paramiko.SSHException as err:
            hint = (" -- ssh to it once to record its key, or set "
                    "experiment.runner.ssh.known_hosts=auto_add"
                    if "known_hosts" in str(err) or "not found in" in str(err) else "")
            raise HostError(self.address, f"SSH to {self.where()} failed: {err}{hint}") from None
        except OSError as err:  # timeouts included
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise HostError(self.address, f"cannot connect to SSH at {self.where()}: {reason}") from None
        if ssh.known_hosts == "auto_add":
            known.parent.mkdir(parents=True, exist_ok=True)
            self.client.save_host_keys(str(known))
        return self

    def run(self, argv: list[str], timeout: float = 120.0) -> Result:
        """Run an argument list on the host (quoted for its login shell); wait for it."""
        try:
            _stdin, stdout, stderr = self.client.exec_command(command_line(argv), timeout=timeout)
            out = stdout.read().decode(errors="replace")
            err = stderr.read().decode(errors="replace")
            return Result(stdout.channel.recv_exit_status(), out, err)
        except (paramiko.SSHException, OSError) as err:  # timeouts included
            raise HostError(self.address, f"command failed over SSH ({type(err).__name__}: {err}): "
                            f"{argv[:6]}") from None

    def run_json(self, argv: list[str], timeout: float = 120.0) -> dict:
        """Run an agent verb: its last stdout line is JSON; a failure raises HostError."""
        result = self.run(argv, timeout)
        lines = result.stdout.strip().splitlines()
        if result.rc != 0 or not lines:
            detail = (result.stderr.strip() or result.stdout.strip())[-3000:]
            raise HostError(self.address, f"{_verb(argv)} failed (exit {result.rc}):\n{detail}")
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise HostError(self.address, f"{_verb(argv)}: unexpected output {lines[-1]!r}") from None

    # -- SFTP ----------------------------------------------------------------------------
    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self.client.open_sftp()
        return self._sftp

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        parts = PurePosixPath(path).parts
        try:
            for i in range(2, len(parts) + 1):
                sub = str(PurePosixPath(*parts[:i]))
                try:
                    self.sftp.stat(sub)
                except FileNotFoundError:
                    self.sftp.mkdir(sub, mode)
        except (OSError, paramiko.SSHException) as err:
            raise HostError(self.address, f"cannot create {path} over SFTP as {self.user!r}: "
                            f"{err} (exp_dir must be writable at the same path on every host)") from None

    def put_bytes(self, data: bytes, path: str, mode: int = 0o644) -> None:
        """Write a file on the host, created with `mode` before any byte is written."""
        try:
            self.makedirs(str(PurePosixPath(path).parent))
            tmp = f"{path}.tmp{os.getpid()}"
            with self.sftp.open(tmp, "wb") as f:
                f.chmod(mode)
                f.write(data)
            self.sftp.posix_rename(tmp, path)
        except (OSError, paramiko.SSHException) as err:
            raise HostError(self.address, f"cannot write {path} over SFTP as {self.user!r}: "
                            f"{err} (exp_dir must be writable at the same path on every host)") from None

    def get_tree(self, remote: str, local: Path) -> int:
        """Copy a directory of the host here (files only, symlinks skipped). Returns files."""
        count = 0
        try:
            entries = self.sftp.listdir_attr(remote)
        except FileNotFoundError:
            return 0
        local.mkdir(parents=True, exist_ok=True)
        for entry in entries:
            src, dst = f"{remote}/{entry.filename}", local / entry.filename
            if stat.S_ISDIR(entry.st_mode or 0):
                count += self.get_tree(src, dst)
            elif stat.S_ISREG(entry.st_mode or 0):
                self.sftp.get(src, str(dst))
                count += 1
        return count

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self.client.close()


class Connections:
    """The SSH connections of one runner action, one per host: each opened on first use,
    all closed together (stop, undoing a failed run, reuses the run's)."""

    def __init__(self, runner: RunnerConfig):
        self.runner = runner
        self._by_address: dict[str, Connection] = {}

    def __enter__(self) -> Connections:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def open(self, host: Host) -> Connection:
        if host.address not in self._by_address:
            self._by_address[host.address] = Connection(host, self.runner).connect()
        return self._by_address[host.address]

    def __getitem__(self, address: str) -> Connection:
        return self._by_address[address]

    def close(self) -> None:
        for conn in self._by_address.values():
            conn.close()


def recorded_host(record: HostRecord) -> Host:
    """A host as `run` reached it (its records), for stop and status: no hostfile needed."""
    return Host(record.address, 1, ssh_port=record.ssh_port, user=record.user)


def _verb(argv: list[str]) -> str:
    if "flagserve.runner.agent" in argv:
        i = argv.index("flagserve.runner.agent")
        return f"agent {argv[i + 1]}" if i + 1 < len(argv) else "agent"
    return argv[0] if argv else "command"
