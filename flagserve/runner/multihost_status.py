"""action=status across the hosts of a run: per host its Ray node, its recorded processes and
the Serve replicas running there, then the application's deployments."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict

from flagserve.cluster.records import (
    ExpPaths,
    HostRecord,
    ProcessRecord,
    RayRecord,
    load_hosts,
    load_processes,
    load_ray,
)
from flagserve.config.schema import Config
from flagserve.runner import host_commands as cmd
from flagserve.runner.ray_status import DeploymentStatus
from flagserve.runner.ssh import SSH_MARGIN_S, Connection, HostError, recorded_host

STATUS_TIMEOUT_S = 60.0  # one host's agent status verb


def print_status(config: Config, paths: ExpPaths) -> int:
    records, hosts, ray_record = load_processes(paths), load_hosts(paths), load_ray(paths)
    if not records:
        print(f"{config.experiment.exp_name}: not running (no records in {paths.run})")
        return 1
    views = host_views(config, records, hosts, ray_record)
    lines, ok = status_lines(config, hosts, views, ray_record)
    print("\n".join(lines))
    return 0 if ok else 1


def host_views(config: Config, records: list[ProcessRecord], hosts: list[HostRecord],
               ray_record: RayRecord | None) -> dict[str, dict]:
    """What the agent on each host reports: its processes; on the head also health, Ray nodes,
    actors and deployments. {"error": ...} for a host that cannot be asked."""
    views: dict[str, dict] = {}
    for host in hosts:
        recs = [asdict(r) for r in records if r.host == host.address]
        ray = asdict(ray_record) if host.head and ray_record else None
        try:
            with Connection(recorded_host(host), config.experiment.runner) as conn:
                conn.connect()
                views[host.address] = conn.run_json(cmd.host_status(config, host.address, recs, ray),
                                                    timeout=STATUS_TIMEOUT_S + SSH_MARGIN_S)
        except HostError as err:
            views[host.address] = {"error": str(err), "processes": []}
    return views


def status_lines(config: Config, hosts: list[HostRecord], views: dict[str, dict],
                 ray_record: RayRecord | None) -> tuple[list[str], bool]:
    """(what status prints, whether all is well)."""
    head = next((h for h in hosts if h.head), hosts[0])
    hv = views.get(head.address, {})
    healthy = hv.get("healthy", False)
    app = hv.get("app_status", "UNKNOWN")
    url = ray_record.endpoint if ray_record else "?"
    lines = [f"{config.experiment.exp_name}: {'healthy' if healthy else 'UNHEALTHY'} at {url}; "
             f"application {app} (ray namespace {config.namespace}, {len(hosts)} hosts)"]
    host_lines, ok = _host_lines(hosts, views, hv)
    lines += host_lines
    if "ray_error" in hv:
        lines.append(f"  ray: cannot read the cluster: {hv['ray_error']}")
        ok = False
    lines += [f"  deployment {DeploymentStatus(**d).line()}" for d in hv.get("deployments", [])]
    ok = ok and all("error" not in v for v in views.values())
    return lines, ok and healthy and app == "RUNNING"


def _host_lines(hosts: list[HostRecord], views: dict[str, dict], hv: dict) -> tuple[list[str], bool]:
    """Per host: its Ray node (from the head's view), processes, Serve replicas."""
    nodes = {n["address"]: n for n in hv.get("nodes", []) if n["alive"]}
    actors = defaultdict(list)
    for a in hv.get("actors", []):
        actors[a["address"]].append(_actor_label(a))
    lines, ok = [], True
    for host in hosts:
        view = views.get(host.address, {})
        node = nodes.get(host.address)
        res = ", ".join(f"{k} {v:g}" for k, v in sorted(node["resources"].items())) if node else ""
        lines.append(f"  host {host.address}{' (head)' if host.head else ''}: "
                     + (f"ray node alive ({res})" if node else "NO RAY NODE"))
        if "error" in view:
            lines.append(f"    {view['error']}")
        for p in view.get("processes", []):
            lines.append(f"    process {p['name']}: pid {p['pid']} {'alive' if p['alive'] else 'DEAD'}, "
                         f"log {p['log']}")
            ok = ok and p["alive"]
        if actors.get(host.address):
            lines.append(f"    serve: {', '.join(sorted(actors[host.address]))}")
        ok = ok and node is not None
    return lines, ok


def _actor_label(actor: dict) -> str:
    """A Serve replica `ServeReplica:<app>:<deployment>` -> the deployment; else the class."""
    cls = actor["class"]
    if cls.startswith("ServeReplica:"):
        return cls.rsplit(":", 1)[-1]
    return {"ServeController": "serve controller", "ProxyActor": "http proxy"}.get(cls, cls)
