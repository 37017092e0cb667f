"""Accept FlagScale serve YAML: the list form and vLLM-style engine_args, mapped to ours.

    - serve_id: vllm_model            ->  serve:
      engine: vllm                          vllm_model:
      engine_args: {model: ..., port: 9010}   engine: flagserve, engine_args: {model: ...}
                                          experiment.runner.deploy.port: 9010

Every mapping that changes meaning is reported as a note, never applied silently.
"""
from __future__ import annotations

import dataclasses
from typing import Any, get_args

from flagserve.config.errors import ConfigError
from flagserve.config.flagscale_disagg import map_disaggregation
from flagserve.config.schema import DeployConfig
from flagserve.engine.engine_args import LoadFormat

# vLLM server/engine flags FlagScale configs carry that have no counterpart here: accepted
# so such a YAML runs, and listed in a note.
VLLM_IGNORED = frozenset({
    "trust_remote_code", "uvicorn_log_level", "disable_log_requests",
    "disable_log_stats", "compilation_config", "distributed_executor_backend",
    "disable_custom_all_reduce", "swap_space", "enable_log_requests",
})
# vLLM engine args taken where set to what FlagServe does anyway (another value is an error:
# EngineArgs has no such field).
VLLM_NEUTRAL: dict[str, Any] = {
    "quantization": None, "revision": None, "tokenizer_revision": None, "download_dir": None,
    "enable_lora": False, "data_parallel_size": 1, "kv_cache_dtype": "auto",
    "tokenizer_mode": "auto", "hf_overrides": None, "num_gpu_blocks_override": None,
}


def vllm_only(key: str, value: Any) -> bool:
    """Whether `key` is a vLLM engine arg FlagServe takes and drops: one that changes no output
    here (VLLM_IGNORED), or one set to FlagServe's own behaviour (VLLM_NEUTRAL)."""
    return key in VLLM_IGNORED or (key in VLLM_NEUTRAL and value == VLLM_NEUTRAL[key])


# vLLM names whose FlagServe meaning lives elsewhere in the experiment.
SERVER_ARGS = {"host": "host", "port": "port", "api_key": "api_key"}
RENAMED = {"model_tag": "model", "tokenizer_path": "tokenizer"}
ENGINE_ALIASES = {"vllm": "flagserve"}  # an engine whose configs FlagServe's engine serves
# FlagScale's experiment.runner.deploy switches that have no counterpart here: use_fs_serve
# picks between FlagScale's own launcher and Ray Serve, and FlagServe always uses Ray Serve.
DEPLOY_IGNORED = frozenset({"use_fs_serve"})


def normalize(raw: dict[str, Any], engine_arg_names: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Return (config dict in FlagServe's shape, notes for the user). Does not mutate `raw`."""
    raw = dict(raw)
    notes: list[str] = []
    serve = raw.get("serve")
    if isinstance(serve, list):
        serve = _list_to_mapping(serve)
    elif serve is not None and not isinstance(serve, dict):
        raise ConfigError("serve", f"must be a mapping of module id to module, got {serve!r}",
                          "see conf/serve/tiny.yaml for the shape")
    serve = dict(serve or {})
    deploy_moves: dict[str, Any] = {}
    for module_id, entry in serve.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"serve.{module_id}", f"must be a mapping, got {entry!r}",
                              "give each module engine_args (an LLM) or module+name (user code)")
        serve[module_id] = _normalize_module(module_id, dict(entry), engine_arg_names,
                                             deploy_moves, notes)
    raw["serve"] = serve
    _map_deploy_keys(raw, serve, notes)
    if deploy_moves:
        _move_to_deploy(raw, deploy_moves, notes)
    return raw, notes


def _list_to_mapping(entries: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("serve_id"), str):
            raise ConfigError(f"serve.{i}", "a list entry needs a `serve_id` string",
                              "write `- serve_id: my_model` as the first key of each entry")
        entry = dict(entry)
        module_id = entry.pop("serve_id")
        if module_id in out:
            raise ConfigError(f"serve.{i}.serve_id", f"duplicate serve_id {module_id!r}",
                              "give every module a distinct serve_id")
        out[module_id] = entry
    return out


def _normalize_module(module_id: str, entry: dict[str, Any], engine_arg_names: set[str],
                      deploy_moves: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    if "module" in entry:  # user module: nothing vLLM-specific to map
        return entry
    engine = entry.get("engine", "flagserve")
    if engine in ENGINE_ALIASES:
        notes.append(f"serve.{module_id}.engine: `{engine}` is served by FlagServe's own engine "
                     f"(engine: {ENGINE_ALIASES[engine]}); vLLM-only engine_args are ignored")
        entry["engine"] = ENGINE_ALIASES[engine]
    args = entry.get("engine_args")
    if isinstance(args, dict):
        entry["engine_args"] = _normalize_engine_args(module_id, args, engine_arg_names,
                                                      entry, deploy_moves, notes)
    return entry


def _normalize_engine_args(module_id: str, args: dict[str, Any], names: set[str],
                           entry: dict[str, Any], deploy_moves: dict[str, Any],
                           notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ignored = []
    spelled: dict[str, str] = {}  # normalised key -> as the file wrote it
    for raw_key, value in args.items():
        key = RENAMED.get(str(raw_key).replace("-", "_"), str(raw_key).replace("-", "_"))
        if key.startswith("no_") and key[3:] in names and isinstance(value, bool):
            key, value = key[3:], not value  # vLLM's --no-enable-prefix-caching
        if key in spelled:  # max-num-seqs and max_num_seqs: which one is meant?
            raise ConfigError(f"serve.{module_id}.engine_args.{raw_key}",
                              f"sets {key} again (also as {spelled[key]})", "keep one of them")
        spelled[key] = str(raw_key)
        if key in SERVER_ARGS:
            deploy_moves[SERVER_ARGS[key]] = (f"serve.{module_id}.engine_args.{key}", value)
        elif key == "served_model_name":
            entry.setdefault("model_name", value)
        elif vllm_only(key, value):
            ignored.append(key)
        elif key == "load_format" and value not in get_args(LoadFormat):
            ignored.append(f"load_format={value}")  # vLLM's file formats: read by format here
        else:
            out[key] = value
    if ignored:
        notes.append(f"serve.{module_id}.engine_args: ignoring vLLM-only {', '.join(ignored)}")
    return out


def _map_deploy_keys(raw: dict[str, Any], serve: dict[str, Any], notes: list[str]) -> None:
    """FlagScale's experiment.runner.deploy switches: dropped, or mapped onto the module."""
    experiment = raw.get("experiment")
    runner = experiment.get("runner") if isinstance(experiment, dict) else None
    deploy = runner.get("deploy") if isinstance(runner, dict) else None
    if not isinstance(deploy, dict):
        return
    ignored = sorted(DEPLOY_IGNORED & deploy.keys())
    if ignored:
        notes.append(f"experiment.runner.deploy: ignoring FlagScale-only {', '.join(ignored)} "
                     "(FlagServe always deploys with Ray Serve)")
    mapped = map_disaggregation({k: v for k, v in deploy.items() if k not in DEPLOY_IGNORED},
                                serve, notes)
    if mapped != deploy:
        raw["experiment"] = {**experiment, "runner": {**runner, "deploy": mapped}}


def _move_to_deploy(raw: dict[str, Any], moves: dict[str, Any], notes: list[str]) -> None:
    experiment = dict(raw.get("experiment") or {})
    runner = dict(experiment.get("runner") or {})
    deploy = dict(runner.get("deploy") or {})
    defaults = {f.name: f.default for f in dataclasses.fields(DeployConfig)}
    for name, (source, value) in moves.items():
        # The experiment's own default (conf/serve.yaml and the examples spell out port 8000)
        # is no choice to conflict with: FlagScale's engine_args value is the one meant.
        if name in deploy and deploy[name] not in (value, defaults.get(name)):
            raise ConfigError(source, f"conflicts with experiment.runner.deploy.{name}="
                              f"{deploy[name]!r}", f"set only experiment.runner.deploy.{name}")
        deploy[name] = value
        notes.append(f"{source} -> experiment.runner.deploy.{name}={value!r}")
    runner["deploy"] = deploy
    experiment["runner"] = runner
    raw["experiment"] = experiment
