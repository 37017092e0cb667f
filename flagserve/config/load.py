"""From the composed Hydra config to a validated Config: normalize, type-check, validate."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flagserve.config.errors import ConfigError
from flagserve.config.flagscale import normalize
from flagserve.config.schema import PARALLEL_ARGS, Config, ExperimentConfig, LLMModule, UserModule
from flagserve.config.typed import build, coerce, unknown_key_error
from flagserve.engine.engine_args import EngineArgs

ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)} | set(PARALLEL_ARGS)


def to_plain(cfg: DictConfig | dict) -> dict[str, Any]:
    """Resolve interpolations (${...}) into a plain dict, reporting a bad one by key."""
    if isinstance(cfg, dict):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(str(key), f"cannot be resolved: {getattr(err, 'msg', err)}",
                          "fix the ${...} interpolation or set the environment variable it reads"
                          ) from None


def parse_config(cfg: DictConfig | dict) -> tuple[Config, list[str]]:
    """Type-check the composed config; returns it with notes about FlagScale mappings."""
    raw, notes = normalize(to_plain(cfg), ENGINE_ARG_NAMES)
    known = {f.name for f in dataclasses.fields(Config)}
    for key in raw:
        if key not in known:
            raise unknown_key_error("", key, sorted(known))
    hints = typing.get_type_hints(Config)
    config = Config(
        experiment=build(ExperimentConfig, raw.get("experiment"), "experiment"),
        serve={mid: _build_module(mid, entry) for mid, entry in raw.get("serve", {}).items()},
        **{k: coerce(hints[k], raw[k], k) for k in ("action", "foreground") if k in raw},
    )
    return config, notes


def _build_module(module_id: str, entry: dict[str, Any]) -> LLMModule | UserModule:
    path = f"serve.{module_id}"
    if "module" in entry or "name" in entry:
        if "engine_args" in entry or "engine" in entry:
            raise ConfigError(path, "has both engine_args (an LLM) and module/name (user code)",
                              "split it into two modules and link them with `depends`")
        return build(UserModule, entry, path)
    if not {"engine_args", "builtin_model", "tiny_model"} & set(entry):
        raise ConfigError(path, "is neither an LLM nor a user module",
                          f"give it {path}.engine_args.model=/path/to/hf_model, or "
                          f"{path}.module=file.py + {path}.name=ClassName")
    module = build(LLMModule, entry, path)
    _check_engine_args(module.engine_args, f"{path}.engine_args")
    if module.disaggregation is not None:
        for role in ("prefill", "decode"):
            _check_engine_args(getattr(module.disaggregation, role).engine_args,
                               f"{path}.disaggregation.{role}.engine_args")
    return module


def _check_engine_args(args: dict[str, Any], path: str) -> None:
    """Known EngineArgs names with values of their types (converted in place)."""
    hints = typing.get_type_hints(EngineArgs)
    for key, value in args.items():
        if key not in ENGINE_ARG_NAMES:
            raise unknown_key_error(path, key, sorted(ENGINE_ARG_NAMES))
        if value is not None:  # null: EngineArgs' default (model: the tiny model's, later)
            args[key] = coerce(hints[key], value, f"{path}.{key}")
