"""One interface over where a deployment runs: this host, or the hosts of a hostfile over SSH.

deployment_for picks the implementation once, from the config; run.py's actions (run, stop,
status, test, plan, bench) then call it without asking which.
"""
from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from pathlib import Path

import yaml

from flagserve.cluster.records import ExpPaths, write_private
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.runner.console import print_ready, same_command


class Deployment(ABC):
    """The serving graph of one experiment, its records under exp_dir/run/.

    `hosts`: where it runs (the hostfile's, or this host); stop and status need none, they
    work from the records `run` left."""

    def __init__(self, config: Config, hosts: list[Host]):
        self.config = config
        self.hosts = hosts
        self.paths = ExpPaths(Path(config.experiment.exp_dir))

    def recorded(self) -> dict:
        """The config as exp_dir/config.yaml keeps it: resolved, with the API key in force
        (one from $FLAGSERVE_API_KEY too, which a later `status` shell may not have)."""
        record = dataclasses.asdict(self.config)
        record["experiment"]["runner"]["deploy"]["api_key"] = self.config.api_key
        return record

    def save_config(self) -> None:
        """The config the serving process starts from, which holds the API key: its owner
        alone reads it."""
        write_private(self.paths.config, yaml.safe_dump(self.recorded(), sort_keys=False).encode())

    def where(self) -> str:
        """For the ready message, after the URL: where it runs (nothing on this host alone)."""
        return ""

    def print_ready(self, hints: bool) -> None:
        print_ready(self.config, self.endpoint, self.where(), hints)

    def already_running(self, hints: bool) -> int:
        """`run` again while it runs (is_running): fine when it runs this very config (make
        serve twice), else an error. Compared with the exp_dir/config.yaml `run` saved."""
        name = self.config.experiment.exp_name
        try:
            saved = yaml.safe_load(self.paths.config.read_text())
        except (OSError, yaml.YAMLError):
            saved = None
        ours = {k: v for k, v in self.recorded().items() if k not in ("action", "foreground")}
        if not isinstance(saved, dict) or {k: v for k, v in saved.items() if k in ours} != ours:
            print(f"{name} is already running with another config (records in {self.paths.run}); "
                  f"stop it first: {same_command('stop')}", file=sys.stderr)
            return 1
        print(f"{name} is already running (the same config)", flush=True)
        self.print_ready(hints)
        return 0

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The URL of the OpenAI API as this machine reaches it (no /v1)."""

    @abstractmethod
    def roles(self) -> list[tuple[Host, str]]:
        """What runs on each host, for plan; empty on this host alone."""

    @abstractmethod
    def is_running(self) -> bool:
        """Records of a deployment that `stop` has not yet ended."""

    @abstractmethod
    def run(self, hints: bool = True) -> int:
        """Start it, wait until /health answers, print its endpoint and (`hints`) how to use
        and stop it. Returns the exit code."""

    @abstractmethod
    def stop(self) -> int:
        """Stop exactly what `run` started and forget its records. Returns the exit code."""

    @abstractmethod
    def status(self) -> int:
        """Print its health, processes and Serve deployments; 0 when all is well."""


def deployment_for(config: Config, hosts: list[Host]) -> Deployment:
    """The multi-host deployment when the config names a hostfile, else this host's."""
    # Imported here: the multi-host runner brings paramiko, which a local run never needs.
    if config.experiment.runner.hostfile:
        from flagserve.runner.multihost import MultiHostDeployment
        return MultiHostDeployment(config, hosts)
    from flagserve.runner.local import LocalDeployment
    return LocalDeployment(config, hosts)
