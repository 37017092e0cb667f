"""The Deployment the runner picks (once, from the config), where each one is reached, and
the multi-host stop order and status report, without starting anything."""
from __future__ import annotations

import pytest

from flagserve.cluster.records import HostRecord, ProcessRecord, RayRecord
from flagserve.config import parse_config
from flagserve.config.hostfile import Host, parse_hostfile_text
from flagserve.runner.deployment import deployment_for
from flagserve.runner.local import LocalDeployment
from flagserve.runner.multihost import MultiHostDeployment
from flagserve.runner.multihost_status import status_lines
from flagserve.runner.multihost_stop import stop_steps

HOSTS = parse_hostfile_text("10.0.0.1 slots=2 type=cpu\n10.0.0.2 slots=2 type=cpu\n")


def config(tmp_path, hostfile: bool, bind: str = "127.0.0.1"):
    cfg, _ = parse_config({"experiment": {
        "exp_name": "demo", "exp_dir": str(tmp_path),
        "runner": {"hostfile": "h.txt" if hostfile else None, "deploy": {"host": bind, "port": 8123}}}})
    return cfg


def test_a_hostfile_picks_the_multi_host_deployment(tmp_path):
    multi = deployment_for(config(tmp_path, hostfile=True), HOSTS)
    assert isinstance(multi, MultiHostDeployment)
    assert [role for _, role in multi.roles()] == ["Ray head + serving process", "Ray node"]
    local = deployment_for(config(tmp_path, hostfile=False), [Host("127.0.0.1", 2, "cpu")])
    assert isinstance(local, LocalDeployment)
    assert local.roles() == []
    assert not local.is_running() and not multi.is_running()  # no records yet


@pytest.mark.parametrize("bind, local_url, multi_url", [
    ("0.0.0.0", "http://127.0.0.1:8123", "http://10.0.0.1:8123"),
    ("::", "http://127.0.0.1:8123", "http://10.0.0.1:8123"),
    ("127.0.0.1", "http://127.0.0.1:8123", "http://127.0.0.1:8123"),
    ("10.0.0.1", "http://10.0.0.1:8123", "http://10.0.0.1:8123"),
])
def test_a_wildcard_bind_is_reached_at_loopback_or_the_head(tmp_path, bind, local_url, multi_url):
    assert deployment_for(config(tmp_path, False, bind), []).endpoint == local_url
    assert deployment_for(config(tmp_path, True, bind), HOSTS).endpoint == multi_url


def record(name: str, host: str) -> ProcessRecord:
    return ProcessRecord(name, 1, 0.0, [name], None, host)


def test_stop_takes_down_the_server_then_the_workers_then_the_head():
    head, worker = HostRecord("10.0.0.1", "u", 22, False, True), HostRecord("10.0.0.2", "u", 22, False)
    records = [record("ray-head", head.address), record("ray-worker", worker.address),
               record("server", head.address)]
    steps = [(s.host.address, [r.name for r in s.records], s.last)
             for s in stop_steps(records, [head, worker])]
    assert steps == [("10.0.0.1", ["server"], False), ("10.0.0.2", ["ray-worker"], True),
                     ("10.0.0.1", ["ray-head"], True)]
    assert stop_steps(records, []) == []  # no hosts.json: every record is of an unknown host


def test_status_names_each_host_and_fails_on_an_unreachable_one(tmp_path):
    head, worker = HostRecord("10.0.0.1", "u", 22, False, True), HostRecord("10.0.0.2", "u", 22, False)
    node = {"alive": True, "resources": {"CPU": 2.0}}
    views = {head.address: {
        "healthy": True, "app_status": "RUNNING",
        "processes": [{"name": "server", "pid": 7, "alive": True, "log": "s.log"}],
        "nodes": [{**node, "address": head.address}, {**node, "address": worker.address}],
        "actors": [{"class": "ServeReplica:demo:llm-engine", "address": worker.address}],
        "deployments": [{"name": "llm-engine", "status": "HEALTHY", "replicas": {"RUNNING": 1},
                         "message": ""}]},
        worker.address: {"processes": []}}
    ray = RayRecord("10.0.0.1:6379", "ns", "demo", None, "http://10.0.0.1:8123")
    lines, ok = status_lines(config(tmp_path, True), [head, worker], views, ray)
    assert ok
    assert lines[0] == ("demo: healthy at http://10.0.0.1:8123; application RUNNING "
                        "(ray namespace flagserve-demo, 2 hosts)")
    assert "  host 10.0.0.2: ray node alive (CPU 2)" in lines
    assert "    serve: llm-engine" in lines
    assert "  deployment llm-engine           HEALTHY    replicas: 1 running" in lines
    views[worker.address] = {"error": "host 10.0.0.2: cannot connect", "processes": []}
    lines, ok = status_lines(config(tmp_path, True), [head, worker], views, ray)
    assert not ok and "    host 10.0.0.2: cannot connect" in lines
