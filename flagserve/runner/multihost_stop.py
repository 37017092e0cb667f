"""action=stop across the hosts of a run: every recorded process, host by host (the serving
process on the head, then every other host, then the head's Ray node); each host checks that
its processes are gone and the hosts' logs are copied to exp_dir/logs/<address>/. Records of
hosts that could not be stopped are kept, so stop can be repeated."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flagserve.cluster.records import (
    ExpPaths,
    HostRecord,
    ProcessRecord,
    clear,
    load_hosts,
    load_processes,
    save_processes,
)
from flagserve.config.schema import Config
from flagserve.runner import host_commands as cmd
from flagserve.runner.ssh import SSH_MARGIN_S, Connection, Connections, HostError, recorded_host

STOP_TIMEOUT_S = 120.0  # one host's agent stop verb


@dataclass
class StopStep:
    host: HostRecord
    records: list[ProcessRecord]
    last: bool  # nothing of the run is left on the host after it: keep Ray's logs, after_stop


def stop_steps(records: list[ProcessRecord], hosts: list[HostRecord]) -> list[StopStep]:
    """The serving process first (it shuts Serve down while the nodes are still up), then the
    other hosts, the head last."""
    head = next((h for h in hosts if h.head), hosts[0] if hosts else None)
    if head is None:
        return []
    front = [r for r in records if r.host == head.address and r.name == "server"]
    steps = [StopStep(head, front, last=False)] if front else []
    for host in [h for h in hosts if not h.head] + [head]:
        rest = [r for r in records if r.host == host.address and r not in front]
        steps.append(StopStep(host, rest, last=True))
    return steps


def stop_all(config: Config, paths: ExpPaths, conns: Connections) -> int:
    """Stop every recorded process; report per host. Returns the exit code."""
    records, hosts = load_processes(paths), load_hosts(paths)
    failed: dict[str, list[ProcessRecord]] = {}
    report: list[str] = []
    for step in stop_steps(records, hosts):
        address = step.host.address
        if address in failed:  # its serving process survived: leave the rest for the next stop
            failed[address] += step.records
            continue
        lines, stopped = _stop_step(config, conns, step)
        report += lines
        if not stopped:
            failed[address] = failed.get(address, []) + step.records
    unknown = [r for r in records if r.host not in {h.address for h in hosts}]
    if unknown:
        report.append(f"  records of unknown hosts kept: {unknown}")
    return _conclude(config.experiment.exp_name, paths, report, failed, unknown)


def _stop_step(config: Config, conns: Connections, step: StopStep) -> tuple[list[str], bool]:
    """(report lines, whether every process of the step is gone)."""
    host = step.host
    try:
        conn = conns.open(recorded_host(host))
        out = conn.run_json(cmd.stop_host(config, host.address, [asdict(r) for r in step.records],
                                          step.last), timeout=STOP_TIMEOUT_S + SSH_MARGIN_S)
    except HostError as err:
        return [f"  {host.address}: NOT stopped: {err}"], False
    if out["survivors"]:
        return [f"  {host.address}: could not stop: {', '.join(out['survivors'])}"], False
    names = ", ".join(f"{s['name']} (pid {s['pid']}{'' if s['was_alive'] else ', already gone'})"
                      for s in out["stopped"])
    if step.last:
        logs = _collect_logs(config, conn, host)
        lines = [f"  {host.address}: stopped {names or 'nothing'}; no process left; logs in {logs}"]
    else:
        lines = [f"  {host.address}: stopped {names}"]
    if out.get("after_stop") not in (None, 0):
        lines.append(f"  {host.address}: experiment.cmds.after_stop exited {out['after_stop']}")
    return lines, True


def _conclude(name: str, paths: ExpPaths, report: list[str],
              failed: dict[str, list[ProcessRecord]], unknown: list[ProcessRecord]) -> int:
    """Print the report; keep the records of what is left, or forget the run."""
    print(f"{name}: {'stopped' if not failed and not unknown else 'stop INCOMPLETE'}")
    print("\n".join(report))
    if failed or unknown:
        save_processes(paths, [r for recs in failed.values() for r in recs] + unknown)
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
