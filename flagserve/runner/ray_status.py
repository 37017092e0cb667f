"""Deployments and replicas of a running experiment, read from its Ray cluster."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from flagserve.cluster.ray_env import LOOPBACK_NODE_ENV
from flagserve.runner.environment import ray_auth_env


@dataclass
class DeploymentStatus:
    name: str
    status: str
    replicas: dict[str, int]  # replica state -> count
    message: str = ""

    def line(self) -> str:
        """`name  status  replicas: 1 running[  message]`, as status prints it."""
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(self.replicas.items()))
        return (f"{self.name:<20} {self.status:<10} replicas: {replicas or 'none'}"
                + (f"  {self.message}" if self.message else ""))


def serve_status(gcs_address: str, namespace: str, app_name: str, token_file: Path,
                 disconnect: bool = True) -> tuple[str, list[DeploymentStatus]]:
    """(application status, its deployments). Connects as a short-lived Ray driver (left
    connected with disconnect=False, for more questions; the caller then calls ray.shutdown)."""
    os.environ.update(ray_auth_env(token_file))
    if gcs_address.split(":")[0] in ("127.0.0.1", "localhost"):
        # a single-host run's cluster: reached on loopback only (before Ray is imported)
        os.environ.update(LOOPBACK_NODE_ENV)
    import ray
    from ray import serve

    ray.init(address=gcs_address, namespace=namespace, logging_level=logging.ERROR,
             log_to_driver=False)
    try:
        apps = serve.status().applications
        app = apps.get(app_name)
        if app is None:
            return "NOT_DEPLOYED", []
        deployments = [
            DeploymentStatus(name, str(getattr(d.status, "value", d.status)),
                             {str(getattr(k, "value", k)): v for k, v in d.replica_states.items()},
                             d.message)
            for name, d in app.deployments.items()]
        return str(getattr(app.status, "value", app.status)), deployments
    finally:
        if disconnect:
            ray.shutdown()
