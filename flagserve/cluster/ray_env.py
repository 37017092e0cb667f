"""The Ray environment of an experiment: token authentication, the object store size, and
the Ray settings every serving process starts with (each can be overridden in
`experiment.envs`, or in the environment run.py is started from).

The four Serve switches are the non-experimental part of Ray's
`RAY_SERVE_THROUGHPUT_OPTIMIZED=1` bundle; what each does: README, "The serving graph" (Ray Serve settings);
what they save: docs/performance.md.
"""
from __future__ import annotations

import hashlib

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    # The raylet starts every worker at nice 15 (Ray's default, for batch jobs): the engine
    # replicas and their engine processes would then yield their cores to Ray's own daemons
    # and anything else on the host at nice 0, op after op.
    "RAY_worker_niceness": "0",
    # Ray's background work, which a deployment pays on every core it shares with its engine
    # (a CPU host's only ones): Serve's controller loop at 0.5 s instead of 0.1 s (its ticks
    # and the GCS calls they make were ~7% of a core idle; start and stop took no longer),
    # and none of Ray's own metrics, task events and event-loop stats, which FlagServe reads
    # nowhere (its /metrics is its own).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_enable_metrics_collection": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "5000",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
}

OBJECT_STORE_BYTES = 256 * 2**20  # Serve moves small messages; don't reserve GBs of /dev/shm

# A cluster of this host alone talks to nobody else, so its node address is loopback, and
# Ray then binds every listener of its own to loopback: the GCS, raylet and worker gRPC
# servers, the dashboard agent, the metrics exports. ray.init turns a 127.0.0.1 given as
# _node_ip_address into the host's address; this switch (Ray's, for single-machine clusters
# on macOS and Windows) is what keeps it loopback. Read when Ray is imported.
LOOPBACK_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOCAL_HOST = "localhost"  # the host part of a single-host run's ray_temp_dir


def token_auth_env(token_path: str) -> dict[str, str]:
    """Ray token authentication with a token of this experiment only (never ~/.ray/auth_token,
    which every Ray user of the machine shares): only holders of exp_dir can join or connect."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def ray_temp_dir(exp_dir: str, address: str) -> str:
    """Ray's temp dir of one experiment on one host (its session, sockets and logs): short
    (Ray's unix socket paths must fit 107 bytes) and distinct per experiment and host, also
    when hosts share a filesystem; `stop` removes it, and nothing of other runs."""
    digest = hashlib.sha1(f"{exp_dir}|{address}".encode()).hexdigest()[:12]
    return f"/tmp/flagserve-ray-{digest}"
