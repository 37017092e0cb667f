"""The exact argument lists the multi-host runner sends to each host."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from flagserve.cluster.ray_env import SERVE_ENV
from flagserve.config import parse_config
from flagserve.config.hostfile import parse_hostfile_text
from flagserve.runner import host_commands as cmd
from flagserve.runner.environment import REPO_ROOT
from flagserve.runner.ssh import ssh_target

PY = "/opt/venv/bin/python"
AGENT = ["env", f"PYTHONPATH={REPO_ROOT}", PY, "-m", "flagserve.runner.agent"]
HOSTS = parse_hostfile_text("10.0.0.1 slots=8 type=gpu\n"
                            "10.0.0.2 slots=4 type=cpu ssh_port=2222 user=ops\n")
HEAD, WORKER = HOSTS


def config(**experiment):
    exp = {"exp_name": "demo", "exp_dir": "/srv/exp",
           "runner": {"hostfile": "h.txt", "python": PY, "ray_port": 6400},
           "envs": {"NCCL_DEBUG": "INFO", "FLAG": True}}
    exp.update(experiment)
    cfg, _ = parse_config({"experiment": exp})
    return cfg


AUTH = ["--env=NCCL_DEBUG=INFO", "--env=FLAG=1", *(f"--env={k}={v}" for k, v in SERVE_ENV.items()),
        "--env=RAY_AUTH_MODE=token"]


def test_head_node():
    argv = cmd.start_node(config(cmds={"before_start": "source /etc/profile.d/cuda.sh"}), HEAD, HEAD)
    tmp = cmd.HostPaths("/srv/exp", "10.0.0.1").ray_temp_dir
    assert argv == AGENT + [
        "spawn", "--name=ray-head", "--log=/srv/exp/logs/10.0.0.1/ray-head.log",
        f"--cwd={REPO_ROOT}", *AUTH,
        "--env=RAY_AUTH_TOKEN_PATH=/srv/exp/hosts/10.0.0.1/ray_auth_token",
        "--env=RAY_USAGE_STATS_ENABLED=0", "--env=RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0",
        "--before-start=source /etc/profile.d/cuda.sh",
        "--wait-port=10.0.0.1:6400", "--timeout=120", "--",
        "/opt/venv/bin/ray", "start", "--block", "--head", "--port=6400",
        "--node-ip-address=10.0.0.1", "--num-gpus=8",
        '--resources={"host:10.0.0.1": 1000}', f"--object-store-memory={256 * 2**20}",
        f"--temp-dir={tmp}", "--disable-usage-stats", "--include-dashboard=false"]
    assert len(f"{tmp}/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store") < 107


def test_worker_node_joins_the_head_with_cpus_and_its_host_resource():
    argv = cmd.start_node(config(), WORKER, HEAD)
    assert argv[argv.index("--") + 1:] == [
        "/opt/venv/bin/ray", "start", "--block", "--address=10.0.0.1:6400",
        "--node-ip-address=10.0.0.2", "--num-cpus=4", "--num-gpus=0",
        '--resources={"host:10.0.0.2": 1000}', f"--object-store-memory={256 * 2**20}",
        f"--temp-dir={cmd.HostPaths('/srv/exp', '10.0.0.2').ray_temp_dir}",
        "--disable-usage-stats"]
    assert "--name=ray-worker" in argv and not any(a.startswith("--wait-port") for a in argv)
    # each host reads the token from its own copy in the experiment dir, never ~/.ray
    assert "--env=RAY_AUTH_TOKEN_PATH=/srv/exp/hosts/10.0.0.2/ray_auth_token" in argv
    temp_dirs = {cmd.HostPaths("/srv/exp", a).ray_temp_dir for a in ("10.0.0.1", "10.0.0.2")}
    assert len(temp_dirs) == 2


def test_server_on_the_head_joins_the_cluster():
    argv = cmd.start_server(config(), HEAD, "/srv/exp/config.yaml")
    assert argv[:len(AGENT) + 3] == AGENT + ["spawn", "--name=server",
                                             "--log=/srv/exp/logs/10.0.0.1/server.log"]
    assert argv[argv.index("--") + 1:] == [
        PY, "-m", "flagserve.serve", "--config=/srv/exp/config.yaml",
        "--cluster=/srv/exp/hosts/10.0.0.1/cluster.json"]


def test_stop_status_and_health():
    rec = {"name": "ray-worker", "pid": 42, "create_time": 1.5, "argv": ["ray"], "log": None,
           "host": "10.0.0.2", "session": True}
    cfg = config(cmds={"after_stop": "echo done"})
    assert cmd.stop_host(cfg, "10.0.0.2", [rec]) == AGENT + [
        "stop", f"--records={json.dumps([rec])}", "--server-grace=60",
        f"--ray-temp-dir={cmd.HostPaths('/srv/exp', '10.0.0.2').ray_temp_dir}",
        "--logs=/srv/exp/logs/10.0.0.2", "--remove=/srv/exp/hosts/10.0.0.2/ray_auth_token",
        "--remove=/srv/exp/hosts/10.0.0.2/cluster.json", "--remove=/srv/exp/hosts/10.0.0.2",
        "--remove=/srv/exp/hosts", "--env=NCCL_DEBUG=INFO", "--env=FLAG=1",
        "--after-stop=echo done"]
    # stopping the server alone leaves Ray's temp dir and after_stop to the host's last call
    assert cmd.stop_host(cfg, "10.0.0.1", [rec], last=False) == AGENT + [
        "stop", f"--records={json.dumps([rec])}", "--server-grace=60"]  # drain 30 s + 30 s
    ray = {"gcs_address": "10.0.0.1:6400", "namespace": "flagserve-demo", "app_name": "demo"}
    assert cmd.host_status(cfg, "10.0.0.1", [rec], ray) == AGENT + [
        "status", f"--records={json.dumps([rec])}", f"--ray={json.dumps(ray)}",
        "--token=/srv/exp/hosts/10.0.0.1/ray_auth_token"]
    assert cmd.wait_healthy(cfg, "http://127.0.0.1:8000", rec) == AGENT + [
        "wait-healthy", "--url=http://127.0.0.1:8000", "--timeout=600",
        f"--record={json.dumps(rec)}"]


def test_command_line_is_the_quoted_argument_list():
    argv = cmd.start_node(config(cmds={"before_start": "export A='x y'; echo $HOME"}), HEAD, HEAD)
    assert shlex.split(cmd.command_line(argv)) == argv


def test_defaults_ssh_target_and_python():
    cfg, _ = parse_config({"experiment": {"runner": {"hostfile": "h.txt", "ssh_port": 2200,
                                                     "ssh": {"user": "svc"}}}})
    assert cmd.python_of(cfg) == sys.executable
    assert Path(cmd.start_node(cfg, HEAD, HEAD)[cmd.start_node(cfg, HEAD, HEAD).index("--") + 1]) \
        == Path(sys.executable).parent / "ray"
    assert ssh_target(HEAD, cfg.experiment.runner) == ("svc", 2200)  # config defaults
    assert ssh_target(WORKER, cfg.experiment.runner) == ("ops", 2222)  # the hostfile wins
