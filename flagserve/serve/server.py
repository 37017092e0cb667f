"""The serving process: deploys the graph on a Ray cluster, waits for SIGTERM.

    python -m flagserve.serve --config EXP_DIR/config.yaml
    python -m flagserve.serve --config EXP_DIR/config.yaml --cluster CLUSTER.json

Started by `run.py action=run` (flagserve.runner). Alone, it owns a Ray cluster on this host,
whose listeners are all on loopback (ray_env.LOOPBACK_NODE_ENV); `action=stop` sends SIGTERM,
on which it drains the ingress replicas' HTTP (deploy.drain_timeout_s), deletes the
application (every replica drains what is left), shuts down Serve and then Ray, whose
processes it started and which die with it. With --cluster (the multi-host runner starts it
on the head), it joins the Ray cluster the runner started on the hosts of the hostfile, waits
until every host's node is up, deploys, and on SIGTERM shuts down Serve only: the nodes are
the runner's.

It holds the lock of deploy.port (cluster/port_owner.py) for its whole life: inherited from
`run` (--port-lock-fd), or taken at start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path

import yaml

from flagserve.cluster.port_owner import OwnerRecord, PortTakenError, take_port
from flagserve.cluster.ray_env import (
    LOCAL_HOST,
    LOOPBACK_NODE_ENV,
    OBJECT_STORE_BYTES,
    SERVE_ENV,
    ray_temp_dir,
)
from flagserve.cluster.records import ExpPaths, RayRecord, save_ray
from flagserve.config import parse_config
from flagserve.config.hostfile import Host, local_host
from flagserve.config.schema import Config
from flagserve.config.topology import direct_http, engine_groups

log = logging.getLogger("flagserve.server")  # its INFO lines are `run`'s progress
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flagserve.serve")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--cluster", type=Path, help="join this cluster (multi-host runner)")
    parser.add_argument("--port-lock-fd", type=int, help="the port's lock, taken by `run`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    config, _ = parse_config(yaml.safe_load(args.config.read_text()))
    stop = threading.Event()
    _stop_on_signals(stop)
    if not _hold_port(config, args.port_lock_fd):
        return 1
    # Ray and Ray Serve read their settings when imported, in this process and in every Ray
    # worker (which inherit this environment when this process starts the cluster).
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    if args.cluster is None:
        os.environ.update(LOOPBACK_NODE_ENV)
    import ray

    cluster = json.loads(args.cluster.read_text()) if args.cluster is not None else None
    hosts = _init_ray(config, cluster)
    # ray.init installs Ray's own SIGTERM handler (it logs a stack trace and exits at once,
    # before Serve is shut down): take SIGTERM/SIGINT back.
    _stop_on_signals(stop)
    try:
        if cluster is not None:
            wait_for_nodes(hosts, float(cluster.get("node_timeout_s", 120)))
        else:
            _record_cluster(config)
        _serve_until(stop, config, hosts)
    finally:
        ray.shutdown()
    return 0


def _hold_port(config: Config, fd: int | None) -> bool:
    """Hold deploy.port's lock for the life of this process; False when another has it."""
    if fd is not None:
        os.set_inheritable(fd, False)  # held by this process, not by the Ray processes it starts
        return True
    owner = OwnerRecord(config.experiment.exp_name, config.experiment.exp_dir, _bind_url(config),
                        config.deploy.port)
    try:
        take_port(owner)  # the fd stays open, and the lock held, until this process ends
    except PortTakenError as err:
        log.error("%s; stop it first, or pick another port (experiment.runner.deploy.port)", err)
        return False
    return True


def _stop_on_signals(stop: threading.Event) -> None:
    def on_signal(*_):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _init_ray(config: Config, cluster: dict | None) -> list[Host]:
    """Join the runner's cluster (`cluster`), or start one on this host, which dies with this
    process. Returns the hosts to deploy on."""
    import ray

    if cluster is not None:
        ray.init(address=cluster["address"], namespace=config.namespace,
                 logging_level=logging.WARNING)
        return [Host(**h) for h in cluster["hosts"]]
    hosts = [local_host(config.experiment.envs)]
    log.info("starting a Ray cluster on this host (its listeners on loopback; README: What listens where)")
    ray.init(namespace=config.namespace, include_dashboard=False, num_cpus=logical_cpus(config),
             object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING,
             _temp_dir=ray_temp_dir(config.experiment.exp_dir, LOCAL_HOST))
    return hosts


def _record_cluster(config: Config) -> None:
    """The cluster this process started, in the run's records (for status), and its logs
    linked under exp_dir/logs/ray."""
    import ray

    paths = ExpPaths(Path(config.experiment.exp_dir))
    node = ray._private.worker.global_worker.node  # noqa: SLF001 - the session dir
    session_dir = node.get_session_dir_path()
    _link_ray_logs(paths, Path(session_dir) / "logs")
    save_ray(paths, RayRecord(ray.get_runtime_context().gcs_address, config.namespace,
                              config.experiment.exp_name, session_dir, _bind_url(config)))


def _serve_until(stop: threading.Event, config: Config, hosts: list[Host]) -> None:
    """Deploy the graph; on `stop`, shut Serve down (also while it is still deploying)."""
    from ray import serve

    from flagserve.serve.app import build_app

    deploy = config.deploy
    # With deploy.http_server = replicas the ingress replicas listen on the port
    # themselves; Serve starts no proxy.
    serve.start(http_options={"host": deploy.host, "port": deploy.port},
                proxy_location="Disabled" if direct_http(config) else "HeadOnly")
    name = config.experiment.exp_name
    log.info("deploying %s: %s (each engine replica loads its model)", name,
             ", ".join(g.name for g in engine_groups(config)))
    # serve.run waits until every replica is up (model loads: minutes); on a thread, so that
    # a stop meanwhile deletes the application at once instead of after the wait.
    pool = ThreadPoolExecutor(1, thread_name_prefix="deploy")
    deployed = pool.submit(serve.run, build_app(config, hosts), name=name, route_prefix="/")
    pool.shutdown(wait=False)
    while not stop.wait(0.25) and not deployed.done():
        pass
    if not stop.is_set():
        deployed.result()  # a failed deploy raises here, as serve.run did
        log.info("serving %s at %s", name, _bind_url(config))
        stop.wait()
    log.info("stopping: new requests are refused; running ones get up to %g s",
             deploy.drain_timeout_s)
    _drain_ingress(config)
    # Deleting the application then stops every replica (one the drain above missed drains
    # now, up to deploy.drain_timeout_s) while Serve's HTTP proxy, which serve.shutdown()
    # kills at once, still delivers their responses.
    serve.delete(name)
    serve.shutdown()


def _drain_ingress(config: Config) -> None:
    """Drain the HTTP of every ingress replica (drain.py) before the application is deleted.

    Deleting it stops every deployment at once. A request that reached a separate ingress in
    the half second before that replica's own drain began then waited for an engine replica,
    of which its router has none while they stop, until the drain timeout cut it: a 503 after
    deploy.drain_timeout_s instead of at once. Drained first, the ingress refuses new requests
    at once while the engines still serve the running ones."""
    try:
        if _ingress_running(config):
            asyncio.run(_broadcast_drain(config))
    except Exception as err:  # noqa: BLE001 - deleting the application drains them all the same
        log.warning("draining the ingress before the engines failed (%s); deleting the "
                    "application drains every replica at once", err)


def _ingress_running(config: Config) -> bool:
    """Whether an ingress replica runs (none yet: a stop while deploying). Asked of Serve, not
    of serve.run's return: a replica serves HTTP, and `run` reports the server up, a moment
    before the application counts as running."""
    from ray import serve

    from flagserve.serve.app import ingress_name

    app = serve.status().applications.get(config.experiment.exp_name)
    ingress = app.deployments.get(ingress_name(config)) if app is not None else None
    return ingress is not None and ingress.replica_states.get("RUNNING", 0) > 0


async def _broadcast_drain(config: Config) -> None:
    from ray.serve.handle import DeploymentHandle

    from flagserve.serve.app import SHUTDOWN_MARGIN_S, ingress_name

    # A handle of its own, not serve.get_deployment_handle's cached one: its router runs on
    # this loop (SERVE_ENV), and serve.shutdown() would shut a cached one down after the loop
    # has closed.
    handle = DeploymentHandle(ingress_name(config), config.experiment.exp_name)
    try:
        await handle.broadcast("drain_http").results_async(
            timeout_s=config.deploy.drain_timeout_s + SHUTDOWN_MARGIN_S)
    finally:
        await handle.shutdown_async()


def _bind_url(config: Config) -> str:
    return f"http://{config.deploy.host}:{config.deploy.port}"


def wait_for_nodes(hosts: list[Host], timeout_s: float) -> None:
    """Block until a live Ray node runs on every host, or fail naming the missing ones."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        missing = [h.address for h in hosts if h.address not in alive]
        if not missing:
            log.info("all %d Ray nodes are up: %s", len(hosts), ", ".join(sorted(alive)))
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Ray node joined from host(s) {', '.join(missing)} within "
                               f"{timeout_s:g} s; see exp_dir/logs/<host>/ray-worker.log")
        time.sleep(0.5)


def logical_cpus(config) -> int:
    """This host's CPUs plus one per CPU shard worker: TP x PP on CPU oversubscribes the cores
    rather than leave the shards' placement group waiting for CPUs this host never has."""
    from flagserve.config.topology import uses_gpu
    host = local_host(config.experiment.envs)
    shards = sum(m.world_size * max(m.resources.num_replicas, m.resources.min_replicas or 1)
                 for m in config.llms.values() if m.world_size > 1 and not uses_gpu(m, [host]))
    return (os.cpu_count() or 1) + shards


def _link_ray_logs(paths: ExpPaths, target: Path) -> None:
    link = paths.logs / "ray"
    if link.is_dir() and not link.is_symlink():  # an earlier run's logs, kept at its stop
        link.rename(next(p for n in count(1) if not (p := link.with_name(f"ray.{n}")).exists()))
    link.unlink(missing_ok=True)
    link.symlink_to(target, target_is_directory=True)

