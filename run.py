"""FlagServe's entry point: a Hydra experiment config and an action.

    .venv/bin/python run.py --config-name serve action=run       # serve conf/serve.yaml in the background
    .venv/bin/python run.py --config-name serve action=status    # health, deployments, replicas
    .venv/bin/python run.py --config-name serve action=stop      # stop exactly what run started
    .venv/bin/python run.py --config-path examples/qwen2_5/conf --config-name serve action=plan

Exit codes: 0 done, 1 the action failed, 2 the config is wrong.
"""
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

_task_started = False
# Hydra raises what it cannot compose (a mistyped key, a missing file) instead of printing
# its own message: ours names the key and the fix (flagserve/config/overrides.py).
_USER_FULL_ERROR = bool(os.environ.get("HYDRA_FULL_ERROR"))
os.environ["HYDRA_FULL_ERROR"] = "1"


@hydra.main(config_path="conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from flagserve.runner.cli import execute

    if _is_multirun():
        _private_sweep_config()
    code = execute(cfg)
    if _is_multirun():  # one job of several: the others still run; exit after the last
        _multirun_codes.append(code)
        return
    sys.exit(code)


_multirun_codes: list[int] = []


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.get().mode == RunMode.MULTIRUN


def _private_sweep_config() -> None:
    """Hydra writes the composed config of a sweep (an API key with it) to multirun.yaml."""
    from hydra.core.hydra_config import HydraConfig
    saved = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    if saved.exists():
        saved.chmod(0o600)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        # Hydra's own command-line errors (e.g. an unknown option) exit 1 before the task
        # starts: a config error too.
        if exit_.code == 1 and not _task_started:
            sys.exit(2)
        raise
    except Exception as err:
        if _task_started or _USER_FULL_ERROR:
            raise
        from flagserve.config.overrides import override_error
        print(override_error(err, sys.argv[1:]), file=sys.stderr)
        sys.exit(2)
    if _multirun_codes:  # -m: every point ran; bench points get a combined table
        from flagserve.runner.bench import finish_sweep
        finish_sweep()
        sys.exit(max(_multirun_codes))
