"""The Deployment on this host: one serving process that owns its Ray cluster and its port."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from flagserve.cluster import http
from flagserve.cluster.port_owner import OwnerRecord, PortTakenError, take_port
from flagserve.cluster.ray_env import LOCAL_HOST, ray_temp_dir
from flagserve.cluster.records import ProcessRecord, clear, load_processes, load_ray, save_processes
from flagserve.cluster.sessions import is_alive
from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.config.validate import HOST_FIX
from flagserve.runner.console import Progress, tail
from flagserve.runner.deployment import Deployment
from flagserve.runner.environment import hook_env, run_hook, server_env
from flagserve.runner.launcher import server_grace_s, spawn, terminate
from flagserve.runner.locate import running_elsewhere
from flagserve.runner.ray_logs import remove_ray_temp_dir
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

    def run(self, hints: bool = True) -> int:
        config, paths = self.config, self.paths
        if self.is_running():
            return self.already_running(hints)
        owner = OwnerRecord(config.experiment.exp_name, config.experiment.exp_dir, self.endpoint,
                            config.deploy.port)
        try:
            lock = take_port(owner)  # before anything starts: one experiment per port
        except PortTakenError as err:
            print(f"{config.experiment.exp_name} cannot start: {err}; stop it first, or pick "
                  "another port (experiment.runner.deploy.port)", file=sys.stderr)
            return 1
        created = not paths.root.exists()
        try:
            _check_port_free(config)
            paths.make()
            clear(paths)
            self.save_config()
            proc, record, log = self._spawn(lock)
        except BaseException:  # (before_start failed, the port is taken): it leaves nothing behind
            if created:
                shutil.rmtree(paths.root, ignore_errors=True)
            raise
        finally:
            os.close(lock)  # the serving process holds the lock now (or nobody does)
        if config.foreground:
            return self._attach(proc, record)
        print(f"starting {config.experiment.exp_name} (pid {proc.pid}, log {log}) ...", flush=True)
        return self._wait_ready(proc, record, log, created, hints)

    def _spawn(self, lock: int) -> tuple[subprocess.Popen, ProcessRecord, Path | None]:
        config, paths = self.config, self.paths
        env = server_env(config, paths.ray_token)
        argv = [sys.executable, "-m", "flagserve.serve", "--config", str(paths.config),
                "--port-lock-fd", str(lock)]
        log = None if config.foreground else paths.log("server")
        self.progress = Progress(log)
        proc, record = spawn("server", argv, env, log, cwd=os.getcwd(), pass_fds=(lock,))
        save_processes(paths, [record])
        return proc, record, log

    def _wait_ready(self, proc: subprocess.Popen, record: ProcessRecord, log: Path,
                    created: bool, hints: bool) -> int:
        url = self.endpoint
        if not http.wait_healthy(url, self.config.deploy.startup_timeout_s,
                                 lambda: proc.poll() is None, self.progress.show):
            if proc.poll() is not None and self._stopped_meanwhile():
                print(f"{self.config.experiment.exp_name} was stopped (action=stop) before it "
                      "became healthy", file=sys.stderr)
                return 1
            timeout = self.config.deploy.startup_timeout_s
            why = (f"did not become healthy within {timeout:g} s "
                   f"(experiment.runner.deploy.startup_timeout_s)" if proc.poll() is None
                   else f"exited with {proc.returncode} before it became healthy")
            print(f"{self.config.experiment.exp_name} {why} at {url}/health", file=sys.stderr)
            print(tail(log, LOG_LINES, record.log_offset), file=sys.stderr)
            terminate(record, grace_s=10.0)
            self._forget(keep_logs=not created)
            if created:  # a failed run leaves nothing behind
                shutil.rmtree(self.paths.root, ignore_errors=True)
            return 1
        self.print_ready(hints)
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
            self.print_ready(hints=True)
        code = proc.wait()
        terminate(record, grace_s=5.0)  # anything the server left behind in its session
        self._forget(keep_logs=True)
        return code

    def _stopped_meanwhile(self) -> bool:
        """A `stop` ended this run's server: it is stopping it, or has forgotten the run."""
        return self.paths.stopping.exists() or not self.paths.has_records()

    def _forget(self, keep_logs: bool) -> None:
        """The run's records and its Ray temp dir (logs copied to exp_dir/logs/ray first)."""
        temp = Path(ray_temp_dir(self.config.experiment.exp_dir, LOCAL_HOST))
        remove_ray_temp_dir(temp, self.paths.logs / "ray" if keep_logs else None)
        clear(self.paths)

    def stop(self) -> int:
        config, paths = self.config, self.paths
        records = load_processes(paths)
        if not records:
            print(f"{config.experiment.exp_name}: nothing to stop (no records in {paths.run})"
                  f"{running_elsewhere(config)}")
            return 0
        paths.stopping.touch()
        try:
            survivors = [name for record in records for name in
                         terminate(record, grace_s=server_grace_s(config.deploy.drain_timeout_s))]
            if survivors:
                print(f"could not stop: {', '.join(survivors)}", file=sys.stderr)
                return 1
            self._forget(keep_logs=True)
        finally:
            paths.stopping.unlink(missing_ok=True)
        run_hook(config.experiment.cmds.after_stop, hook_env(config), "experiment.cmds.after_stop")
        pids = ", ".join(str(r.pid) for r in records)
        print(f"{config.experiment.exp_name}: stopped (session of pid {pids}; no process left)")
        return 0

    def status(self) -> int:
        name = self.config.experiment.exp_name
        records = load_processes(self.paths)
        alive = [r for r in records if is_alive(r)]
        if not alive:
            stale = " (stale records: action=stop cleans them up)" if records else ""
            print(f"{name}: not running{stale}{running_elsewhere(self.config)}")
            return 1
        url = self.endpoint
        ok = http.healthy(url)
        print(f"{name}: {'healthy' if ok else 'UNHEALTHY'} at {url}")
        for r in alive:
            print(f"  process {r.name}: pid {r.pid}, log {r.log}")
        self._print_models(url)
        return 0 if self._print_serve_status() and ok else 1

    def _print_models(self, url: str) -> None:
        try:
            code, body = http.request(f"{url}/v1/models", api_key=self.config.api_key)
        except OSError as err:  # URLError too: the server is reported unhealthy above
            print(f"  models: cannot ask {url}/v1/models: {err}")
            return
        if code == 200:
            for m in json.loads(body)["data"]:
                print(f"  model {m['id']}: {m['root']} (max_model_len {m['max_model_len']})")
        else:
            print(f"  models: {url}/v1/models answered HTTP {code}")

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
    """The host is an address of this machine, and no other program listens on the port
    (FlagServe runs are ruled out by its lock)."""
    host, port = config.deploy.host, config.deploy.port
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ConfigError("experiment.runner.deploy.host", f"{host!r} does not resolve ({err.strerror})",
                          HOST_FIX) from None
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                raise ConfigError("experiment.runner.deploy.host",
                                  f"{host} is not an address of this machine", HOST_FIX) from None
            raise ConfigError("experiment.runner.deploy.port",
                              f"{host}:{port} is not available ({err.strerror})",
                              "pick a free port, e.g. experiment.runner.deploy.port=8001") from None
