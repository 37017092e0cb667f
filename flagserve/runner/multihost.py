"""run / stop / status across the hosts of a hostfile, over SSH.

    run:    connect to every host (an unreachable one fails `run` before anything starts);
            copy this run's Ray token to each; start the Ray head on the first host and a Ray
            node on every other one (slots as GPUs or CPUs, a `host:<address>` resource);
            start the serving process on the head, which joins the cluster, waits for every
            node and deploys the Serve graph; wait for /health. A failure on any host undoes
            what was started on all of them.
    stop:   stop every recorded process on every host (server, then nodes), check they are
            gone, copy the hosts' logs to exp_dir/logs/<address>/, report per host.
    status: per host, its processes, Ray node and the Serve replicas running there.

Records are the single-host runner's (processes.json with each record's host, ray.json) plus
hosts.json; the SSH commands are built in host_commands.py.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import yaml

from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.runner import host_commands as cmd
from flagserve.runner.environment import ray_auth_env
from flagserve.runner.placement import stage_hosts
from flagserve.cluster.records import (ExpPaths, HostRecord, ProcessRecord, RayRecord, clear,
                                      load_hosts, load_processes, load_ray, save_hosts,
                                      save_processes, save_ray)
from flagserve.runner.ssh import Connection, HostError

SSH_MARGIN_S = 60.0  # on top of the timeout the agent itself enforces


def endpoints(config: Config, head: str) -> tuple[str, str]:
    """(URL on the head itself, URL for everyone else) of the OpenAI endpoint."""
    host, port = config.deploy.host, config.deploy.port
    if host in ("0.0.0.0", "::"):
        return f"http://127.0.0.1:{port}", f"http://{head}:{port}"
    return f"http://{host}:{port}", f"http://{host}:{port}"


def run(config: Config, hosts: list[Host]) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
    name = config.experiment.exp_name
    if load_processes(paths):
        print(f"{name}: records of a running (or not cleanly stopped) deployment are in "
              f"{paths.run}; stop it first with action=stop", file=sys.stderr)
        return 1
    paths.make()
    clear(paths)
    ray_auth_env(paths.ray_token)
    token = paths.ray_token.read_bytes()
    for module_id, module in config.llms.items():
        if module.world_size > 1 and not module.engine_args.get("placement_hosts"):
            module.engine_args["placement_hosts"] = stage_hosts(config, hosts, module_id)
    paths.config.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    head = hosts[0]
    conns: dict[str, Connection] = {}
    started: list[ProcessRecord] = []
    try:
        for host in hosts:  # all reachable before anything starts
            conns[host.address] = Connection(host, config.experiment.runner).connect()
        save_hosts(paths, [_prepare(config, conns[h.address], h, token, h == head) for h in hosts])
        shared = {r.address: r.shared_fs for r in load_hosts(paths)}
        head_conn = conns[head.address]
        if not shared[head.address]:
            head_conn.put_bytes(paths.config.read_bytes(), str(paths.config))
        cluster = {"address": f"{head.address}:{config.experiment.runner.ray_port}",
                   "hosts": [asdict(h) for h in hosts],
                   "node_timeout_s": config.experiment.runner.node_timeout_s}
        head_conn.put_bytes(json.dumps(cluster, indent=2).encode(),
                            cmd.HostPaths(config.experiment.exp_dir, head.address).cluster)
        for host in hosts:
            role = "head" if host == head else "worker"
            print(f"{name}: starting the Ray {role} node on {host.address} ...", flush=True)
            started.append(_spawn(conns[host.address], cmd.start_node(config, host, head),
                                  config.experiment.runner.node_timeout_s))
            save_processes(paths, started)
        local_url, url = endpoints(config, head.address)
        save_ray(paths, RayRecord(cluster["address"], config.namespace, name, None, url))
        print(f"{name}: starting the serving process on {head.address} ...", flush=True)
        server = _spawn(head_conn, cmd.start_server(config, head, str(paths.config)), 60.0)
        started.append(server)
        save_processes(paths, started)
        head_conn.run_json(cmd.wait_healthy(config, local_url, asdict(server)),
                           timeout=config.deploy.startup_timeout_s + SSH_MARGIN_S)
    except BaseException as err:  # HostError: reported; anything else (^C): undone, re-raised
        if isinstance(err, HostError):
            print(f"{name}: run failed: {err}", file=sys.stderr)
        if started:
            print(f"{name}: undoing what was started ...", file=sys.stderr, flush=True)
            _stop_all(config, paths, conns)
        else:
            clear(paths)
        if not isinstance(err, HostError):
            raise
        return 1
    finally:
        for conn in conns.values():
            conn.close()
    _print_ready(config, url, hosts)
    return 0


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


def stop(config: Config) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
    name = config.experiment.exp_name
    if not load_processes(paths):
        print(f"{name}: nothing to stop (no records in {paths.run})")
        clear(paths)
        return 0
    return _stop_all(config, paths, {})


def _stop_all(config: Config, paths: ExpPaths, conns: dict[str, Connection]) -> int:
    """Stop every recorded process, host by host: the server, the other hosts, the head.
    Records of hosts that could not be stopped are kept, so stop can be repeated."""
    name = config.experiment.exp_name
    records = load_processes(paths)
    hosts = load_hosts(paths)
    by_host: dict[str, list[ProcessRecord]] = defaultdict(list)
    for r in records:
        by_host[r.host].append(r)
    head = next((h for h in hosts if h.head), hosts[0] if hosts else None)
    order = [h for h in hosts if not h.head] + ([head] if head else [])
    front = [r for r in by_host.get(head.address, []) if r.name == "server"] if head else []
    failed: dict[str, list[ProcessRecord]] = {}
    own: list[Connection] = []
    report = []

    def connection(host: HostRecord) -> Connection:
        if host.address not in conns:
            conns[host.address] = Connection(
                Host(host.address, 1, ssh_port=host.ssh_port, user=host.user),
                config.experiment.runner).connect()
            own.append(conns[host.address])
        return conns[host.address]

    def stop_on(host: HostRecord, recs: list[ProcessRecord], last: bool) -> None:
        try:
            conn = connection(host)
            out = conn.run_json(cmd.stop_host(config, host.address, [asdict(r) for r in recs], last),
                                timeout=120 + SSH_MARGIN_S)
        except HostError as err:
            failed[host.address] = failed.get(host.address, []) + recs
            report.append(f"  {host.address}: NOT stopped: {err}")
            return
        if out["survivors"]:
            failed[host.address] = failed.get(host.address, []) + recs
            report.append(f"  {host.address}: could not stop: {', '.join(out['survivors'])}")
            return
        names = ", ".join(f"{s['name']} (pid {s['pid']}{'' if s['was_alive'] else ', already gone'})"
                          for s in out["stopped"])
        if last:
            logs = _collect_logs(config, conn, host)
            report.append(f"  {host.address}: stopped {names or 'nothing'}; no process left; "
                          f"logs in {logs}")
        else:
            report.append(f"  {host.address}: stopped {names}")
        if out.get("after_stop") not in (None, 0):
            report.append(f"  {host.address}: experiment.cmds.after_stop exited {out['after_stop']}")

    try:
        if front:
            stop_on(head, front, last=False)
        for host in order:
            recs = [r for r in by_host.get(host.address, []) if r not in front]
            if host.address in failed:
                failed[host.address] += recs
                continue
            stop_on(host, recs, last=True)
    finally:
        for conn in own:
            conn.close()
    unknown = [r for r in records if r.host not in {h.address for h in hosts}]
    if unknown:
        report.append(f"  records of unknown hosts kept: {unknown}")
    print(f"{name}: {'stopped' if not failed and not unknown else 'stop INCOMPLETE'}")
    print("\n".join(report))
    if failed or unknown:
        left = [r for recs in failed.values() for r in recs] + unknown
        save_processes(paths, left)
        print(f"{name}: fix the hosts above and repeat action=stop", file=sys.stderr)
        return 1
    clear(paths)
    return 0


def _collect_logs(config: Config, conn: Connection, host: HostRecord) -> Path:
    paths = cmd.HostPaths(config.experiment.exp_dir, host.address)
    local = Path(paths.logs)
    if not host.shared_fs:
        try:
            conn.get_tree(paths.logs, local)
        except (OSError, HostError) as err:
            print(f"  {host.address}: could not copy its logs: {err}", file=sys.stderr)
    return local


def status(config: Config) -> int:
    paths = ExpPaths(Path(config.experiment.exp_dir))
    name = config.experiment.exp_name
    records, hosts, ray_record = load_processes(paths), load_hosts(paths), load_ray(paths)
    if not records:
        print(f"{name}: not running (no records in {paths.run})")
        return 1
    views: dict[str, dict] = {}
    ok = True
    for host in hosts:
        recs = [asdict(r) for r in records if r.host == host.address]
        try:
            with Connection(Host(host.address, 1, ssh_port=host.ssh_port, user=host.user),
                            config.experiment.runner) as conn:
                conn.connect()
                views[host.address] = conn.run_json(cmd.host_status(
                    config, host.address, recs, asdict(ray_record) if host.head and ray_record else None),
                    timeout=60 + SSH_MARGIN_S)
        except HostError as err:
            views[host.address] = {"error": str(err), "processes": []}
            ok = False
    head = next((h for h in hosts if h.head), hosts[0])
    hv = views.get(head.address, {})
    healthy = hv.get("healthy", False)
    app = hv.get("app_status", "UNKNOWN")
    url = ray_record.endpoint if ray_record else "?"
    print(f"{name}: {'healthy' if healthy else 'UNHEALTHY'} at {url}; application {app} "
          f"(ray namespace {config.namespace}, {len(hosts)} hosts)")
    nodes = {n["address"]: n for n in hv.get("nodes", []) if n["alive"]}
    actors = defaultdict(list)
    for a in hv.get("actors", []):
        actors[a["address"]].append(_actor_label(a))
    for host in hosts:
        view = views.get(host.address, {})
        node = nodes.get(host.address)
        res = ", ".join(f"{k} {v:g}" for k, v in sorted(node["resources"].items())) if node else ""
        state = f"ray node alive ({res})" if node else "NO RAY NODE"
        print(f"  host {host.address}{' (head)' if host.head else ''}: {state}")
        if "error" in view:
            print(f"    {view['error']}")
        for p in view.get("processes", []):
            print(f"    process {p['name']}: pid {p['pid']} {'alive' if p['alive'] else 'DEAD'}, "
                  f"log {p['log']}")
            ok = ok and p["alive"]
        if actors.get(host.address):
            print(f"    serve: {', '.join(sorted(actors[host.address]))}")
        ok = ok and node is not None
    if "ray_error" in hv:
        print(f"  ray: cannot read the cluster: {hv['ray_error']}")
        ok = False
    for d in hv.get("deployments", []):
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(d["replicas"].items()))
        print(f"  deployment {d['name']:<20} {d['status']:<10} replicas: {replicas or 'none'}"
              + (f"  {d['message']}" if d["message"] else ""))
    return 0 if ok and healthy and app == "RUNNING" else 1


def _actor_label(actor: dict) -> str:
    """A Serve replica `ServeReplica:<app>:<deployment>` -> the deployment; else the class."""
    cls = actor["class"]
    if cls.startswith("ServeReplica:"):
        return cls.rsplit(":", 1)[-1]
    return {"ServeController": "serve controller", "ProxyActor": "http proxy"}.get(cls, cls)


def _print_ready(config: Config, url: str, hosts: list[Host]) -> None:
    from flagserve.runner.local import same_command
    from flagserve.config.topology import served_names
    module_id, module = next(iter(config.llms.items()))
    body = json.dumps({"model": served_names(module_id, module)[0], "prompt": "Hello",
                       "max_tokens": 16})
    where = "" if config.deploy.host not in ("127.0.0.1", "localhost", "::1") else \
        f" (bound to {config.deploy.host} on the head {hosts[0].address} only)"
    print(f"{config.experiment.exp_name} is serving across {len(hosts)} hosts "
          f"({', '.join(h.address for h in hosts)}) at {url}/v1{where}\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
          f"  status: {same_command('status')}\n"
          f"  stop:   {same_command('stop')}", flush=True)
