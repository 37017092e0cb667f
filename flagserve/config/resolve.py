"""Make the config independent of the working directory before it is written to exp_dir."""
from __future__ import annotations

from pathlib import Path

from flagserve.config.schema import Config, LLMModule


def _absolute(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve_paths(config: Config, base: Path) -> None:
    """Relative paths (exp_dir, model, tokenizer, hostfile, user module files) -> absolute."""
    exp = config.experiment
    exp.exp_dir = _absolute(exp.exp_dir, base)
    if exp.runner.hostfile:
        exp.runner.hostfile = _absolute(exp.runner.hostfile, base)
    ssh = exp.runner.ssh
    for key in ("key_file", "known_hosts_file"):
        if getattr(ssh, key):
            setattr(ssh, key, _absolute(getattr(ssh, key), base))
    for module in config.serve.values():
        if isinstance(module, LLMModule):
            for key in ("model", "tokenizer"):
                if module.engine_args.get(key):
                    module.engine_args[key] = _absolute(str(module.engine_args[key]), base)
        else:
            module.module = _absolute(module.module, base) if module.module else module.module


def fill_tiny_models(config: Config, create: bool) -> list[str]:
    """Point LLMs with `tiny_model` and no model at the built-in model; create it if asked.

    Returns notes for the user. Creating needs torch, so only run/test/plan ask for it.
    """
    notes = []
    for module_id, module in config.llms.items():
        if module.engine_args.get("model") or module.tiny_model is None:
            continue
        from flagserve.models.tiny import default_model_dir, ensure_tiny_model
        path = default_model_dir(module.tiny_model)
        if create and not path.exists():
            notes.append(f"serve.{module_id}: creating the built-in tiny {module.tiny_model} "
                         f"model at {path}")
            ensure_tiny_model(path, module.tiny_model)
        module.engine_args["model"] = str(path)
    return notes
