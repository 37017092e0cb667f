"""The multi-host runner's hands on each host, run over SSH:

    python -m flagserve.runner.agent spawn --name N --log L [--env K=V]... [--before-start CMD]
                                           [--cwd D] [--wait-port HOST:PORT --timeout S] -- ARGV...
    python -m flagserve.runner.agent wait-healthy --url URL --timeout S --record JSON
    python -m flagserve.runner.agent stop --records JSON [--ray-temp-dir D] [--logs D]
                                          [--remove PATH]... [--after-stop CMD]
    python -m flagserve.runner.agent status --records JSON [--ray JSON --token FILE]

Each verb prints one JSON object on stdout (the runner parses the last line) and exits 0, or
explains itself on stderr and exits non-zero. Processes are started and stopped with the same
launcher as on a single host: a new session per process, recorded by pid and start time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from flagserve.cluster import http
from flagserve.cluster.records import ProcessRecord
from flagserve.cluster.sessions import is_alive
from flagserve.config.errors import ConfigError
from flagserve.runner.console import tail
from flagserve.runner.environment import _env_after
from flagserve.runner.launcher import server_grace_s, spawn, terminate
from flagserve.runner.ray_logs import remove_ray_temp_dir

LOG_LINES = 30  # of a process's log, in the error when it fails to start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flagserve.runner.agent")
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("spawn")
    p.add_argument("--name", required=True)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--before-start")
    p.add_argument("--cwd")
    p.add_argument("--wait-port")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = verbs.add_parser("wait-healthy")
    p.add_argument("--url", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--record", required=True, type=json.loads)
    p = verbs.add_parser("stop")
    p.add_argument("--records", required=True, type=json.loads)
    p.add_argument("--ray-temp-dir", type=Path)
    p.add_argument("--logs", type=Path)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--remove", action="append", default=[])
    p.add_argument("--after-stop")
    p.add_argument("--server-grace", type=float, default=server_grace_s(0.0))
    p = verbs.add_parser("status")
    p.add_argument("--records", required=True, type=json.loads)
    p.add_argument("--ray", type=json.loads)
    p.add_argument("--token", type=Path)
    args = parser.parse_args(argv)
    try:
        result = {"spawn": _spawn, "wait-healthy": _wait_healthy, "stop": _stop,
                  "status": _status}[args.verb](args)
    except AgentError as err:
        print(err, file=sys.stderr)
        return 1
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


class AgentError(Exception):
    pass


def _spawn(args) -> dict:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise AgentError("spawn: no command given after --")
    env = _with(args.env)
    if args.before_start:
        env = _env_after(args.before_start, env, "experiment.cmds.before_start")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    if args.wait_port:
        host, _, port = args.wait_port.rpartition(":")
        if _port_open(host, int(port)):
            raise AgentError(f"{args.wait_port} is already in use on this host: another Ray "
                             "cluster? set experiment.runner.ray_port to a free port")
    if shutil.which(argv[0], path=env.get("PATH")) is None and not Path(argv[0]).is_file():
        raise AgentError(f"{argv[0]} not found on this host (the same checkout and interpreter "
                         "must exist at the same path on every host; see experiment.runner.python)")
    proc, record = spawn(args.name, argv, env, args.log, cwd=args.cwd)
    if args.wait_port:
        deadline = time.monotonic() + args.timeout
        while not _port_open(host, int(port)):
            if proc.poll() is not None or time.monotonic() > deadline:
                terminate(record, grace_s=5.0)
                why = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"did not open {args.wait_port} within {args.timeout:g} s")
                raise AgentError(f"{args.name} {why}\n"
                                 f"{tail(args.log, LOG_LINES, record.log_offset)}")
            time.sleep(0.3)
    return asdict(record)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_healthy(args) -> dict:
    record = ProcessRecord(**args.record)
    if http.wait_healthy(args.url, args.timeout, lambda: is_alive(record)):
        return {"healthy": True}
    why = "exited" if not is_alive(record) else f"is not healthy after {args.timeout:g} s"
    log = Path(record.log) if record.log else None
    raise AgentError(f"the serving process (pid {record.pid}) {why}; "
                     f"log {record.log}\n{tail(log, LOG_LINES, record.log_offset)}")


def _stop(args) -> dict:
    records = [ProcessRecord(**r) for r in args.records]
    stopped, survivors = [], []
    for record in reversed(records):  # the server before its Ray node
        was_alive = is_alive(record)
        left = terminate(record, grace_s=args.server_grace if record.name == "server" else 10.0)
        survivors += [f"{record.name}: {s}" for s in left]
        if not left:
            stopped.append({"name": record.name, "pid": record.pid, "was_alive": was_alive})
    if args.ray_temp_dir is not None and not survivors:
        remove_ray_temp_dir(args.ray_temp_dir, args.logs / "ray" if args.logs else None)
    if not survivors:
        _remove(args.remove)
    after_stop = None
    if args.after_stop and not survivors:
        rc = subprocess.run(["bash", "-c", args.after_stop], env=_with(args.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = rc.stderr.decode(errors="replace")[-300:]
        after_stop = f"{rc.returncode}: {err}" if err else rc.returncode
    return {"stopped": stopped, "survivors": survivors, "after_stop": after_stop}


def _remove(paths: list[str]) -> None:
    """The run's files on this host (its Ray token), then their dirs, if empty by then."""
    for path in map(Path, paths):
        # a dir may still hold other hosts' files (a shared filesystem): it stays
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)


def _with(items: list[str]) -> dict[str, str]:
    """This environment plus `K=V` items."""
    env = dict(os.environ)
    for item in items:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def _status(args) -> dict:
    records = [ProcessRecord(**r) for r in args.records]
    out: dict = {"processes": [{"name": r.name, "pid": r.pid, "alive": is_alive(r), "log": r.log}
                               for r in records]}
    ray_record = args.ray
    if ray_record is None:
        return out
    # The recorded endpoint names the head, where this runs (a wildcard bind by its address).
    out["healthy"] = http.healthy(ray_record.get("endpoint", ""))
    try:
        out.update(_ray_view(ray_record, args.token))
    except Exception as err:  # noqa: BLE001 - report, don't crash
        out["ray_error"] = f"{type(err).__name__}: {err}"
    return out


def _ray_view(ray_record: dict, token: Path) -> dict:
    """Nodes, the application's deployments, and which host runs each Serve replica."""
    from flagserve.runner.environment import ray_auth_env
    from flagserve.runner.ray_status import serve_status

    os.environ.update(ray_auth_env(token))
    import ray

    app_status, deployments = serve_status(ray_record["gcs_address"], ray_record["namespace"],
                                           ray_record["app_name"], token, disconnect=False)
    try:
        nodes = [{"address": n["NodeManagerAddress"], "alive": n["Alive"],
                  "resources": {k: v for k, v in n["Resources"].items()
                                if not k.startswith("node:") and k not in ("memory", "object_store_memory")}}
                 for n in ray.nodes()]
        actors = []
        for info in ray._private.state.actors().values():  # noqa: SLF001 - GCS table, no dashboard
            if info.get("State") == "ALIVE":
                actors.append({"class": info.get("ActorClassName", ""), "name": info.get("Name", ""),
                               "address": info.get("Address", {}).get("IPAddress", ""),
                               "pid": info.get("Pid")})
    finally:
        ray.shutdown()
    return {"app_status": app_status, "nodes": nodes, "actors": actors,
            "deployments": [asdict(d) for d in deployments]}


if __name__ == "__main__":
    sys.exit(main())
