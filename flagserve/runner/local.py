"""run / stop / status on this host: one serving process that owns its Ray cluster.

The multi-host runner (hostfile over SSH) keeps the same records and verbs; it starts Ray
nodes on every host first and points the serving process at the head.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import yaml

from flagserve.config.errors import ConfigError
from flagserve.config.schema import Config
from flagserve.runner import http
from flagserve.runner.environment import run_hook, server_env
from flagserve.runner.launcher import is_alive, spawn, terminate
from flagserve.runner.ray_status import serve_status
from flagserve.cluster.records import (ExpPaths, clear, load_processes, load_ray,
                                      save_processes)


def endpoint(config: Config) -> str:
    """Where this machine reaches the server (0.0.0.0 binds every interface, incl. loopback)."""
    host = config.deploy.host
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{config.deploy.port}"


def is_running(paths: ExpPaths) -> bool:
    return any(is_alive(r) for r in load_processes(paths))


def run(config: Config) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
    if is_running(paths):
        print(f"{config.experiment.exp_name} is already running (records in {paths.run}); "
              f"stop it first with action=stop", file=sys.stderr)
        return 1
    _check_port_free(config)
    paths.make()
    clear(paths)
    paths.config.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    env = server_env(config, paths.ray_token)
    argv = [sys.executable, "-m", "flagserve.serve", "--config", str(paths.config)]
    log = None if config.foreground else paths.log("server")
    proc, record = spawn("server", argv, env, log, cwd=os.getcwd())
    save_processes(paths, [record])
    url = endpoint(config)
    if config.foreground:
        return _attach(config, proc, record, paths, url)
    print(f"starting {config.experiment.exp_name} (pid {proc.pid}, log {log}) ...", flush=True)
    if not http.wait_healthy(url, config.deploy.startup_timeout_s, lambda: proc.poll() is None):
        print(f"{config.experiment.exp_name} did not become healthy at {url}/health", file=sys.stderr)
        print(_tail(log), file=sys.stderr)
        terminate(record)
        clear(paths)
        return 1
    _print_ready(config, url)
    return 0


def stop(config: Config) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
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
    env = server_env(config)
    run_hook(config.experiment.cmds.after_stop, env, "experiment.cmds.after_stop")
    pids = ", ".join(str(r.pid) for r in records)
    print(f"{config.experiment.exp_name}: stopped (session of pid {pids}; no process left)")
    return 0


def status(config: Config) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
    records = load_processes(paths)
    alive = [r for r in records if is_alive(r)]
    if not alive:
        stale = " (stale records: action=stop cleans them up)" if records else ""
        print(f"{config.experiment.exp_name}: not running{stale}")
        return 1
    url = endpoint(config)
    ok = http.healthy(url)
    print(f"{config.experiment.exp_name}: {'healthy' if ok else 'UNHEALTHY'} at {url}")
    for r in alive:
        print(f"  process {r.name}: pid {r.pid}, log {r.log}")
    code, body = http.request(f"{url}/v1/models", api_key=config.api_key)
    if code == 200:
        for m in json.loads(body)["data"]:
            print(f"  model {m['id']}: {m['root']} (max_model_len {m['max_model_len']})")
    ray_record = load_ray(paths)
    if ray_record is not None:
        try:
            app_status, deployments = serve_status(ray_record.gcs_address, ray_record.namespace,
                                                   ray_record.app_name, paths.ray_token)
        except Exception as err:  # noqa: BLE001 - report, don't crash
            print(f"  ray: cannot read Serve status: {err}")
            return 1
        print(f"  application {ray_record.app_name}: {app_status} (ray namespace "
              f"{ray_record.namespace}, logs {paths.logs / 'ray'})")
        for d in deployments:
            replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(d.replicas.items()))
            print(f"    {d.name:<20} {d.status:<10} replicas: {replicas or 'none'}"
                  + (f"  {d.message}" if d.message else ""))
        ok = ok and app_status == "RUNNING"
    return 0 if ok else 1


def _attach(config: Config, proc, record, paths: ExpPaths, url: str) -> int:
    """foreground=true: stay attached; SIGTERM/SIGINT are passed to the server."""
    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    if http.wait_healthy(url, config.deploy.startup_timeout_s, lambda: proc.poll() is None):
        _print_ready(config, url)
    code = proc.wait()
    terminate(record, grace_s=5.0)  # anything the server left behind in its session
    clear(paths)
    return code


def _check_port_free(config: Config) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((config.deploy.host, config.deploy.port))
        except OSError as err:
            raise ConfigError("experiment.runner.deploy.port",
                              f"{config.deploy.host}:{config.deploy.port} is not available ({err.strerror})",
                              "pick a free port, e.g. experiment.runner.deploy.port=8001") from None


def _print_ready(config: Config, url: str) -> None:
    module_id, module = next(iter(config.llms.items()))
    from flagserve.config.topology import served_names
    body = json.dumps({"model": served_names(module_id, module)[0],
                       "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = " -H 'Authorization: Bearer $FLAGSERVE_API_KEY'" if config.api_key else ""
    print(f"{config.experiment.exp_name} is serving an OpenAI-compatible API at {url}/v1\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d {shlex.quote(body)}\n"
          f"  stop it with: {same_command('stop')}", flush=True)


def same_command(action: str) -> str:
    """This command line with another action, for copy and paste."""
    args = [a for a in sys.argv[1:] if not a.startswith("action=")]
    return shlex.join(["python", "run.py", *args, f"action={action}"])


def _tail(log: Path | None, lines: int = 40) -> str:
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return f"last lines of {log}:\n" + "\n".join(text)
