"""The Deployment on this host: one serving process that owns its Ray cluster."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from flagserve.cluster.records import ProcessRecord, clear, load_processes, load_ray, save_processes
from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.runner import http
from flagserve.runner.console import print_ready, tail
from flagserve.runner.deployment import Deployment
from flagserve.runner.environment import run_hook, server_env
from flagserve.runner.launcher import is_alive, spawn, terminate
from flagserve.runner.ray_status import serve_status

LOG_LINES = 40  # of the server's log, shown when it does not become healthy


class LocalDeployment(Deployment):
    @property
    def endpoint(self) -> str:
        return http.url_of(self.config.deploy.host, self.config.deploy.port)

    def roles(self) -> list[tuple[Host, str]]:
        return []

    def is_running(self) -> bool:
        return any(is_alive(r) for r in load_processes(self.paths))

    def run(self) -> int:
        config, paths = self.config, self.paths
        if self.is_running():
            print(f"{config.experiment.exp_name} is already running (records in {paths.run}); "
                  f"stop it first with action=stop", file=sys.stderr)
            return 1
        _check_port_free(config)
        paths.make()
        clear(paths)
        self.save_config()
        env = server_env(config, paths.ray_token)
        argv = [sys.executable, "-m", "flagserve.serve", "--config", str(paths.config)]
        log = None if config.foreground else paths.log("server")
        proc, record = spawn("server", argv, env, log, cwd=os.getcwd())
        save_processes(paths, [record])
        if config.foreground:
            return self._attach(proc, record)
        print(f"starting {config.experiment.exp_name} (pid {proc.pid}, log {log}) ...", flush=True)
        return self._wait_ready(proc, record, log)

    def _wait_ready(self, proc: subprocess.Popen, record: ProcessRecord, log: Path) -> int:
        url = self.endpoint
        if not http.wait_healthy(url, self.config.deploy.startup_timeout_s,
                                 lambda: proc.poll() is None):
            print(f"{self.config.experiment.exp_name} did not become healthy at {url}/health",
                  file=sys.stderr)
            print(tail(log, LOG_LINES), file=sys.stderr)
            terminate(record)
            clear(self.paths)
            return 1
        print_ready(self.config, url)
        return 0

    def _attach(self, proc: subprocess.Popen, record: ProcessRecord) -> int:
        """foreground=true: stay attached; SIGTERM/SIGINT are passed to the server."""
        def forward(signum, _frame):
            if proc.poll() is None:
                proc.send_signal(signum)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        url = self.endpoint
        if http.wait_healthy(url, self.config.deploy.startup_timeout_s, lambda: proc.poll() is None):
            print_ready(self.config, url)
        code = proc.wait()
        terminate(record, grace_s=5.0)  # anything the server left behind in its session
        clear(self.paths)
        return code

    def stop(self) -> int:
        config, paths = self.config, self.paths
        records = load_processes(paths)
        if not records:
            print(f"{config.experiment.exp_name}: nothing to stop (no records in {paths.run})")
            return 0
        survivors = []
        for record in records:
            survivors += terminate(record)
        if survivors:
            print(f"could not stop: {', '.join(survivors)}", file=sys.stderr)
            return 1
        clear(paths)
        run_hook(config.experiment.cmds.after_stop, server_env(config), "experiment.cmds.after_stop")
        pids = ", ".join(str(r.pid) for r in records)
        print(f"{config.experiment.exp_name}: stopped (session of pid {pids}; no process left)")
        return 0

    def status(self) -> int:
        name = self.config.experiment.exp_name
        records = load_processes(self.paths)
        alive = [r for r in records if is_alive(r)]
        if not alive:
            stale = " (stale records: action=stop cleans them up)" if records else ""
            print(f"{name}: not running{stale}")
            return 1
        url = self.endpoint
        ok = http.healthy(url)
        print(f"{name}: {'healthy' if ok else 'UNHEALTHY'} at {url}")
        for r in alive:
            print(f"  process {r.name}: pid {r.pid}, log {r.log}")
        code, body = http.request(f"{url}/v1/models", api_key=self.config.api_key)
        if code == 200:
            for m in json.loads(body)["data"]:
                print(f"  model {m['id']}: {m['root']} (max_model_len {m['max_model_len']})")
        return 0 if self._print_serve_status() and ok else 1

    def _print_serve_status(self) -> bool:
        """The application and its deployments, from the Ray cluster; False unless RUNNING."""
        ray_record = load_ray(self.paths)
        if ray_record is None:
            return True
        try:
            app_status, deployments = serve_status(ray_record.gcs_address, ray_record.namespace,
                                                   ray_record.app_name, self.paths.ray_token)
        except Exception as err:  # noqa: BLE001 - report, don't crash
            print(f"  ray: cannot read Serve status: {err}")
            return False
        print(f"  application {ray_record.app_name}: {app_status} (ray namespace "
              f"{ray_record.namespace}, logs {self.paths.logs / 'ray'})")
        for d in deployments:
            print(f"    {d.line()}")
        return app_status == "RUNNING"


def _check_port_free(config: Config) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((config.deploy.host, config.deploy.port))
        except OSError as err:
            raise ConfigError("experiment.runner.deploy.port",
                              f"{config.deploy.host}:{config.deploy.port} is not available ({err.strerror})",
                              "pick a free port, e.g. experiment.runner.deploy.port=8001") from None
