"""The Deployment across the hosts of a hostfile, over SSH.

    run:    connect to every host (an unreachable one fails `run` before anything starts);
            copy this run's Ray token to each; start the Ray head on the first host and a Ray
            node on every other one (slots as GPUs or CPUs, a `host:<address>` resource);
            start the serving process on the head, which joins the cluster, waits for every
            node and deploys the Serve graph; wait for /health. A failure on any host undoes
            what was started on all of them.
    stop:   multihost_stop.py; status: multihost_status.py.

Records are the single-host runner's (processes.json with each record's host, ray.json) plus
hosts.json; the SSH commands are built in host_commands.py.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from flagserve.cluster import http
from flagserve.cluster.records import (
    HostRecord,
    ProcessRecord,
    RayRecord,
    clear,
    load_hosts,
    load_processes,
    save_hosts,
    save_processes,
    save_ray,
)
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.runner import host_commands as cmd
from flagserve.runner.deployment import Deployment
from flagserve.runner.environment import ray_auth_env
from flagserve.runner.multihost_status import print_status
from flagserve.runner.multihost_stop import stop_all
from flagserve.runner.placement import stage_hosts
from flagserve.runner.ssh import SSH_MARGIN_S, Connection, Connections, HostError

LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")


class MultiHostDeployment(Deployment):
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def endpoint(self) -> str:
        """On the head; a wildcard bind is reached at the head's address."""
        return http.url_of(self.config.deploy.host, self.config.deploy.port, self.head.address)

    def roles(self) -> list[tuple[Host, str]]:
        return [(h, "Ray head + serving process" if h is self.head else "Ray node")
                for h in self.hosts]

    def is_running(self) -> bool:
        return bool(load_processes(self.paths))

    def run(self, hints: bool = True) -> int:
        self._pin_stages()  # first: the config `run` saved has them, already_running compares
        if self.is_running():
            return self.already_running(hints)
        created = not self.paths.root.exists()
        try:
            self._fresh_records()
            with Connections(self.config.experiment.runner) as conns:
                return self._start_or_undo(conns, hints)
        finally:
            # A failed run forgot its records (_undo): it leaves no exp_dir behind, unless it
            # keeps the records of what it could not stop (one that existed keeps its logs).
            if created and not self.paths.has_records() and self.paths.root.exists():
                shutil.rmtree(self.paths.root, ignore_errors=True)
                print(f"{self.config.experiment.exp_name}: removed {self.paths.root} (this failed "
                      "run created it)", file=sys.stderr)

    def _start_or_undo(self, conns: Connections, hints: bool) -> int:
        name = self.config.experiment.exp_name
        try:
            self._start(conns)
        except BaseException as err:  # HostError: reported; anything else (^C): undone, re-raised
            if isinstance(err, HostError):
                print(f"{name}: run failed: {err}", file=sys.stderr)
            self._undo(conns)
            if not isinstance(err, HostError):
                raise
            return 1
        self.print_ready(hints)
        return 0

    def stop(self) -> int:
        if not self.is_running():
            print(f"{self.config.experiment.exp_name}: nothing to stop (no records in {self.paths.run})")
            clear(self.paths)
            return 0
        with Connections(self.config.experiment.runner) as conns:
            return stop_all(self.config, self.paths, conns)

    def status(self) -> int:
        return print_status(self.config, self.paths)

    def _pin_stages(self) -> None:
        """Each sharded module's stage hosts, from the hostfile, into its engine_args."""
        for module_id, module in self.config.llms.items():
            if module.world_size > 1 and not module.engine_args.get("placement_hosts"):
                module.engine_args["placement_hosts"] = stage_hosts(self.config, self.hosts, module_id)

    def _fresh_records(self) -> None:
        """A new token, and the config (with each module's stage hosts), under exp_dir."""
        self.paths.make()
        clear(self.paths)
        ray_auth_env(self.paths.ray_token)
        self.save_config()

    def _start(self, conns: Connections) -> None:
        """Every host reachable before anything starts; then the Ray nodes, head first; then
        the serving process on the head, until it is healthy. Each is recorded as it starts."""
        config, paths, head = self.config, self.paths, self.head
        started: list[ProcessRecord] = []
        for host in self.hosts:
            conns.open(host)
        self._prepare_hosts(conns)
        for host in self.hosts:
            role = "head" if host == head else "worker"
            print(f"{config.experiment.exp_name}: starting the Ray {role} node on {host.address} ...",
                  flush=True)
            started.append(_spawn(conns[host.address], cmd.start_node(config, host, head),
                                  config.experiment.runner.node_timeout_s))
            save_processes(paths, started)
        save_ray(paths, RayRecord(self._gcs_address, config.namespace, config.experiment.exp_name,
                                  None, self.endpoint))
        print(f"{config.experiment.exp_name}: starting the serving process on {head.address} ...",
              flush=True)
        server = _spawn(conns[head.address], cmd.start_server(config, head, str(paths.config)), 60.0)
        started.append(server)
        save_processes(paths, started)
        on_head = http.url_of(config.deploy.host, config.deploy.port)
        conns[head.address].run_json(cmd.wait_healthy(config, on_head, asdict(server)),
                                     timeout=config.deploy.startup_timeout_s + SSH_MARGIN_S)

    def _prepare_hosts(self, conns: Connections) -> None:
        """The token on every host; the config and the cluster's address on the head."""
        config, paths, head = self.config, self.paths, self.head
        token = paths.ray_token.read_bytes()
        records: list[HostRecord] = []
        for host in self.hosts:  # recorded one by one: _undo removes the tokens already out
            records.append(_prepare(config, conns[host.address], host, token, host == head))
            save_hosts(paths, records)
        head_conn = conns[head.address]
        if not next(r for r in records if r.head).shared_fs:
            head_conn.put_bytes(paths.config.read_bytes(), str(paths.config), mode=0o600)
        cluster = {"address": self._gcs_address, "hosts": [asdict(h) for h in self.hosts],
                   "node_timeout_s": config.experiment.runner.node_timeout_s}
        head_conn.put_bytes(json.dumps(cluster, indent=2).encode(),
                            cmd.HostPaths(config.experiment.exp_dir, head.address).cluster)

    def _undo(self, conns: Connections) -> None:
        """Stop what was started on every host that got the token (and remove it there), or
        just forget the records when no host got it."""
        if load_hosts(self.paths):
            print(f"{self.config.experiment.exp_name}: undoing what was started ...",
                  file=sys.stderr, flush=True)
            stop_all(self.config, self.paths, conns)
        else:
            clear(self.paths)

    @property
    def _gcs_address(self) -> str:
        return f"{self.head.address}:{self.config.experiment.runner.ray_port}"

    def where(self) -> str:
        """For the ready message: the hosts, and that a loopback bind serves the head only."""
        bind = self.config.deploy.host
        only = f"; bound to {bind} on the head {self.head.address} only" if bind in LOOPBACK_BINDS else ""
        return f" across {len(self.hosts)} hosts ({', '.join(h.address for h in self.hosts)}{only})"


def _prepare(config: Config, conn: Connection, host: Host, token: bytes, head: bool) -> HostRecord:
    """Put the run's Ray token on the host (0600) and learn whether it shares exp_dir."""
    paths = cmd.HostPaths(config.experiment.exp_dir, host.address)
    local = Path(paths.token)
    local.unlink(missing_ok=True)  # then a copy seen here after the put means a shared filesystem
    conn.makedirs(paths.logs)
    conn.put_bytes(token, paths.token, mode=0o600)
    shared = local.is_file() and local.read_bytes() == token
    return HostRecord(host.address, conn.user, conn.port, shared, head)


def _spawn(conn: Connection, argv: list[str], timeout: float) -> ProcessRecord:
    record = ProcessRecord(**conn.run_json(argv, timeout=timeout + SSH_MARGIN_S))
    record.host = conn.address
    return record
