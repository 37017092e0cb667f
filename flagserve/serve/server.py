"""The serving process: owns a Ray cluster on this host, deploys the graph, waits for SIGTERM.

    python -m flagserve.serve --config EXP_DIR/config.yaml

Started by `run.py action=run` (flagserve.runner); `action=stop` sends SIGTERM, on which it
shuts down Serve and then Ray, whose processes it started and which die with it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import yaml

from flagserve.config import parse_config
from flagserve.config.hostfile import local_host
from flagserve.runner.records import ExpPaths, RayRecord, save_ray

log = logging.getLogger("flagserve.server")
OBJECT_STORE_BYTES = 256 * 2**20  # Serve moves small messages; don't reserve GBs of /dev/shm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flagserve.serve")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config, _ = parse_config(yaml.safe_load(args.config.read_text()))
    paths = ExpPaths(Path(config.experiment.exp_dir))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    import ray
    from ray import serve

    from flagserve.serve.app import build_app

    deploy = config.deploy
    ray.init(namespace=config.namespace, include_dashboard=False, num_cpus=os.cpu_count(),
             object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING)
    try:
        node = ray._private.worker.global_worker.node  # noqa: SLF001 - the session dir
        session_dir = node.get_session_dir_path()
        _link_ray_logs(paths, Path(session_dir) / "logs")
        endpoint = f"http://{deploy.host}:{deploy.port}"
        save_ray(paths, RayRecord(ray.get_runtime_context().gcs_address, config.namespace,
                                  config.experiment.exp_name, session_dir, endpoint))
        serve.start(http_options={"host": deploy.host, "port": deploy.port},
                    proxy_location="HeadOnly")
        serve.run(build_app(config, [local_host(config.experiment.envs)]),
                  name=config.experiment.exp_name, route_prefix="/")
        log.info("serving %s at %s", config.experiment.exp_name, endpoint)
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def _link_ray_logs(paths: ExpPaths, target: Path) -> None:
    link = paths.logs / "ray"
    link.unlink(missing_ok=True)
    link.symlink_to(target, target_is_directory=True)


if __name__ == "__main__":
    sys.exit(main())
