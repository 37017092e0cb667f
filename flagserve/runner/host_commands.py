"""The argument lists the multi-host runner sends to each host, as pure functions.

Every host runs the same checkout at the same path with the same interpreter (like FlagScale);
what runs there is `python -m flagserve.runner.agent <verb> ...`, which starts, checks and
stops processes with the same launcher as the single-host runner. The SSH command line is
`shlex.join(argv)`: no generated scripts.

Per host, under the experiment dir (the same absolute path on every host):

    exp_dir/hosts/<address>/ray_auth_token   the cluster's token, copied over SFTP (0600)
    exp_dir/hosts/<address>/cluster.json     head only: what the serving process connects to
    exp_dir/logs/<address>/*.log             that host's processes; Ray's logs in ray/ at stop
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from flagserve.cluster.ray_env import (
    OBJECT_STORE_BYTES,
    SERVE_ENV,
    ray_temp_dir,
    token_auth_env,
)
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.distributed.placement import host_resource  # `host:<address>`, what shards pin to
from flagserve.runner.environment import REPO_ROOT
from flagserve.runner.launcher import server_grace_s

HOST_RESOURCE_UNITS = 1000  # `host:<address>` units per node: pin with a fraction of it


@dataclass(frozen=True)
class HostPaths:
    exp_dir: str
    address: str

    @property
    def dir(self) -> str:
        return f"{self.exp_dir}/hosts/{self.address}"

    @property
    def token(self) -> str:
        return f"{self.dir}/ray_auth_token"

    @property
    def cluster(self) -> str:
        return f"{self.dir}/cluster.json"

    @property
    def run_files(self) -> list[str]:
        """What `run` put on the host besides its logs, files before their dirs: the token
        goes at stop (and when a run fails), with the dirs once empty (a filesystem shared by
        the hosts holds every host's dir)."""
        return [self.token, self.cluster, self.dir, f"{self.exp_dir}/hosts"]

    @property
    def logs(self) -> str:
        return f"{self.exp_dir}/logs/{self.address}"

    def log(self, name: str) -> str:
        return f"{self.logs}/{name}.log"

    @property
    def ray_temp_dir(self) -> str:
        return ray_temp_dir(self.exp_dir, self.address)


def python_of(config: Config) -> str:
    return config.experiment.runner.python or sys.executable


def ray_env(paths: HostPaths) -> dict[str, str]:
    return {**token_auth_env(paths.token), "RAY_USAGE_STATS_ENABLED": "0",
            # stop shuts Serve down before the nodes: no need to drain them for 30 s
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def agent(config: Config, verb: str, *args: str) -> list[str]:
    """`python -m flagserve.runner.agent VERB ...` on a host, the checkout on its path."""
    return ["env", f"PYTHONPATH={REPO_ROOT}", python_of(config), "-m", "flagserve.runner.agent",
            verb, *args]


def ray_start(config: Config, host: Host, head: Host) -> list[str]:
    """`ray start` of one node, in the foreground (--block) so that its session is the node."""
    paths = HostPaths(config.experiment.exp_dir, host.address)
    ray = str(Path(python_of(config)).parent / "ray")
    port = config.experiment.runner.ray_port
    argv = [ray, "start", "--block"]
    argv += ["--head", f"--port={port}"] if host == head else [f"--address={head.address}:{port}"]
    argv += [f"--node-ip-address={host.address}"]
    if host.num_gpus:
        argv += [f"--num-gpus={host.num_gpus}"]
    else:
        argv += [f"--num-cpus={host.slots}", "--num-gpus=0"]
    argv += [f"--resources={json.dumps({host_resource(host.address): HOST_RESOURCE_UNITS})}",
             f"--object-store-memory={OBJECT_STORE_BYTES}", f"--temp-dir={paths.ray_temp_dir}",
             "--disable-usage-stats"]
    if host == head:
        argv += ["--include-dashboard=false"]
    return argv


def environment_args(config: Config, paths: HostPaths) -> list[str]:
    """`--env K=V ...` (experiment.envs, Ray Serve's latency settings it leaves unset, then
    Ray's token auth) and `--before-start CMD`."""
    env = config.experiment.exported_envs()
    env.update({k: v for k, v in SERVE_ENV.items() if k not in env})
    env.update(ray_env(paths))
    args = [f"--env={k}={v}" for k, v in env.items()]
    if config.experiment.cmds.before_start:
        args += [f"--before-start={config.experiment.cmds.before_start}"]
    return args


def start_node(config: Config, host: Host, head: Host) -> list[str]:
    """Start this host's Ray node; on the head, wait until its GCS port answers."""
    paths = HostPaths(config.experiment.exp_dir, host.address)
    name = "ray-head" if host == head else "ray-worker"
    args = [f"--name={name}", f"--log={paths.log(name)}", f"--cwd={REPO_ROOT}",
            *environment_args(config, paths)]
    if host == head:
        args += [f"--wait-port={head.address}:{config.experiment.runner.ray_port}",
                 f"--timeout={config.experiment.runner.node_timeout_s:g}"]
    return agent(config, "spawn", *args, "--", *ray_start(config, host, head))


def start_server(config: Config, head: Host, config_file: str) -> list[str]:
    """The serving process on the head: connects to the cluster and deploys the Serve graph."""
    paths = HostPaths(config.experiment.exp_dir, head.address)
    server = [python_of(config), "-m", "flagserve.serve", f"--config={config_file}",
              f"--cluster={paths.cluster}"]
    return agent(config, "spawn", "--name=server", f"--log={paths.log('server')}",
                 f"--cwd={REPO_ROOT}", *environment_args(config, paths), "--", *server)


def wait_healthy(config: Config, url: str, server_record: dict) -> list[str]:
    return agent(config, "wait-healthy", f"--url={url}",
                 f"--timeout={config.deploy.startup_timeout_s:g}",
                 f"--record={json.dumps(server_record)}")


def stop_host(config: Config, address: str, records: list[dict], last: bool = True) -> list[str]:
    """Stop this host's recorded processes (last started first), keep Ray's logs, clean up;
    `last`: nothing else of this run is left on the host, so remove its token and run
    cmds.after_stop there."""
    paths = HostPaths(config.experiment.exp_dir, address)
    args = [f"--records={json.dumps(records)}",
            f"--server-grace={server_grace_s(config.deploy.drain_timeout_s):g}"]
    if last:
        args += [f"--ray-temp-dir={paths.ray_temp_dir}", f"--logs={paths.logs}"]
        args += [f"--remove={path}" for path in paths.run_files]
    if last and config.experiment.cmds.after_stop:
        args += [f"--env={k}={v}" for k, v in config.experiment.exported_envs().items()]
        args += [f"--after-stop={config.experiment.cmds.after_stop}"]
    return agent(config, "stop", *args)


def host_status(config: Config, address: str, records: list[dict],
                ray_record: dict | None = None) -> list[str]:
    args = [f"--records={json.dumps(records)}"]
    if ray_record is not None:
        paths = HostPaths(config.experiment.exp_dir, address)
        args += [f"--ray={json.dumps(ray_record)}", f"--token={paths.token}"]
    return agent(config, "status", *args)


def command_line(argv: list[str]) -> str:
    """What goes over SSH: the argument list quoted for the remote login shell."""
    return shlex.join(argv)
