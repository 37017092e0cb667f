"""The Ray environment of an experiment: token authentication, the object store size, and
the Ray Serve settings every serving process starts with (each can be overridden in
`experiment.envs`, or in the environment run.py is started from).

All four are Ray Serve's own switches, the non-experimental part of what Ray's
`RAY_SERVE_THROUGHPUT_OPTIMIZED=1` bundle sets (that bundle also turns on the experimental
direct ingress, which we leave off). Measured on the default CPU experiment
(docs/performance.md#serving), together they cut the idle round trip of a 1-token
completion from about 14 ms to about 5 ms:

- user code runs on the replica's own event loop instead of a second thread, so a streamed
  item no longer hops between two event loops (and two threads contending for the GIL);
- the handle's router runs on the caller's event loop instead of a thread of its own, the
  same hop on the calling side;
- calls between deployments (ingress -> engine) go over gRPC instead of Ray actor calls;
- Serve's per-request access log lines are written in batches of 1000 (at once when an
  error is logged) instead of one write and flush per request.
"""
from __future__ import annotations

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}

OBJECT_STORE_BYTES = 256 * 2**20  # Serve moves small messages; don't reserve GBs of /dev/shm


def token_auth_env(token_path: str) -> dict[str, str]:
    """Ray token authentication with a token of this experiment only (never ~/.ray/auth_token,
    which every Ray user of the machine shares): only holders of exp_dir can join or connect."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def env_value(value: object) -> str:
    """An `experiment.envs` value as an environment string (YAML booleans as 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
