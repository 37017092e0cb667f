"""`stop` and `status` act on a run as its records describe it, whatever overrides their own
command line carries: with the config the run was started with (exp_dir/config.yaml: its
endpoint, API key, hooks), found under the config's exp_dir or, when there are no records
there and the command line names no exp_dir, through the port locks of this machine's running
experiments (same exp_name). A named exp_dir is the run meant: another run of the same name
is never stopped in its place (a typo, or a second stop of a run already gone)."""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from flagserve.cluster.port_owner import OwnerRecord, owners
from flagserve.cluster.records import ExpPaths
from flagserve.config import ConfigError, parse_config
from flagserve.config.schema import Config


def recorded_config(config: Config, argv: list[str] | None = None) -> Config:
    """The config of the run that `config` names (its action kept); `config` itself when no
    run is recorded. `argv`: the command line's overrides (sys.argv's by default)."""
    paths = ExpPaths(Path(config.experiment.exp_dir))
    argv = sys.argv[1:] if argv is None else argv
    named = any(a.lstrip("+").startswith("experiment.exp_dir=") for a in argv)
    if not paths.has_records() and not named:
        same = [o for o in owners() if o.exp_name == config.experiment.exp_name]
        if len(same) != 1:
            return config
        paths = ExpPaths(Path(same[0].exp_dir))
        print(f"note: {config.experiment.exp_name} runs with its records in {paths.root}",
              file=sys.stderr)
    try:
        saved, _ = parse_config(yaml.safe_load(paths.config.read_text()))
    except (OSError, yaml.YAMLError, ConfigError, TypeError):
        return config  # a run from before config.yaml was kept: what the command line says
    saved.action, saved.foreground = config.action, config.foreground
    return saved


def running_elsewhere(config: Config) -> str:
    """Lines naming the other experiments running here (for `nothing to stop`)."""
    others = [o for o in owners() if o.exp_dir != config.experiment.exp_dir]
    return "".join(f"\n  running here: {o.exp_name} at {o.endpoint} (exp_dir {o.exp_dir}); "
                   f"{_stop_hint(o)}" for o in others)


def _stop_hint(owner: OwnerRecord) -> str:
    from flagserve.runner.console import same_command
    return f"stop it with {same_command('stop', exp_dir=owner.exp_dir)}"
