"""run.py's body: validate the composed config, then run one action. Returns the exit code.

Exit codes: 0 done, 1 the action failed, 2 the config is wrong (one message, no traceback).
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig

from flagserve.config import ConfigError, parse_config
from flagserve.config.hostfile import Host, HostfileError, local_host, parse_hostfile
from flagserve.config.resolve import fill_builtin_models, resolve_paths
from flagserve.config.schema import Config
from flagserve.config.validate import validate_experiment, validate_graph
from flagserve.runner.deployment import deployment_for
from flagserve.runner.locate import recorded_config

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
TRACEBACK_ENV = "FLAGSERVE_TRACEBACK"


def execute(cfg: DictConfig | dict) -> int:
    try:
        config, hosts = load(cfg)
        return dispatch(config, hosts)
    except ConfigError as err:
        print(err.as_typed(cfg.get("serve") if hasattr(cfg, "get") else None), file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return EXIT_FAILED
    except Exception as err:  # noqa: BLE001 - one line, no traceback (README, Actions)
        action = cfg.get("action", "run") if hasattr(cfg, "get") else "run"
        print(f"action={action} failed: {type(err).__name__}: {err}", file=sys.stderr)
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        else:
            print(f"  (set {TRACEBACK_ENV}=1 to see where)", file=sys.stderr)
        return EXIT_FAILED


def load(cfg: DictConfig | dict) -> tuple[Config, list[Host]]:
    config, notes = parse_config(cfg)
    validate_experiment(config)  # first: an empty exp_dir would resolve to the working directory
    resolve_paths(config, Path.cwd())
    # stop and status work from the run's records: a hostfile edited or deleted since is fine
    hosts = inventory(config) if config.action in ("run", "test", "plan", "bench") else []
    if config.action in ("stop", "status"):
        config = recorded_config(config)  # the run as `run` started it, whatever this CLI says
    if config.action in ("run", "test", "plan", "bench"):
        notes += fill_builtin_models(config, create=True)
        validate_graph(config, hosts)
        if config.experiment.runner.hostfile:
            from flagserve.runner.placement import place
            place(config, hosts)  # every shard fits its hosts, or a ConfigError now
    if config.action == "bench":
        from flagserve.config.bench import prepare_bench
        prepare_bench(config, Path.cwd())
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return config, hosts


def inventory(config: Config) -> list[Host]:
    hostfile = config.experiment.runner.hostfile
    if hostfile is None:
        return [local_host({k: str(v) for k, v in config.experiment.envs.items()})]
    if not Path(hostfile).is_file():
        raise ConfigError("experiment.runner.hostfile", f"file {hostfile!r} does not exist",
                          "point it at a hostfile (see hostfiles/) or set it to null")
    try:
        return parse_hostfile(hostfile)
    except HostfileError as err:
        raise ConfigError("experiment.runner.hostfile", str(err),
                          "one host per line: `IP slots=N type=gpu`") from None


def dispatch(config: Config, hosts: list[Host]) -> int:
    deployment = deployment_for(config, hosts)
    if config.action == "plan":
        from flagserve.runner.plan import print_plan
        print_plan(deployment)
        return EXIT_OK
    if config.action == "test":
        from flagserve.runner.smoke import smoke_test
        return smoke_test(deployment)
    if config.action == "bench":
        from flagserve.runner.bench import bench
        return bench(deployment)
    verbs = {"run": deployment.run, "stop": deployment.stop, "status": deployment.status}
    return verbs[config.action]()  # the parse admits only schema.Action's verbs
