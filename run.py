"""FlagServe's entry point: a Hydra experiment config and an action.

    python run.py --config-name serve action=run       # serve conf/serve.yaml in the background
    python run.py --config-name serve action=status    # health, deployments, replicas
    python run.py --config-name serve action=stop      # stop exactly what run started
    python run.py --config-path examples/qwen2_5/conf --config-name serve action=plan

Exit codes: 0 done, 1 the action failed, 2 the config is wrong.
"""
import sys

import hydra
from omegaconf import DictConfig

_task_started = False


@hydra.main(config_path="conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from flagserve.runner.cli import execute

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


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        # Hydra prints its own message and exits 1 when it cannot compose the config (a bad
        # override, a missing config file): that is a config error too.
        if exit_.code == 1 and not _task_started:
            sys.exit(2)
        raise
    if _multirun_codes:  # -m: every point ran; bench points get a combined table
        from flagserve.runner.bench import finish_sweep
        finish_sweep()
        sys.exit(max(_multirun_codes))
