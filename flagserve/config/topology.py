"""Derived facts of a deployment: every `auto` of the config resolved, in one place.

Which module's replicas serve HTTP and how HTTP reaches them, where each engine's step loop
runs, which `model` names route to it, the EngineArgs it is built with, GPU or CPU. The
planner, the runners and the Ray Serve app all ask here, so they cannot disagree;
validate.py only checks that the answers are possible.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule
from flagserve.engine.core.interface import CoreMode
from flagserve.engine.engine_args import EngineArgs


def ingress_in_engine(config: Config) -> str | None:
    """The LLM module whose engine replicas also serve HTTP (deploy.ingress), or None.

    `auto` keeps the ingress out of the engine when the engine has several replicas: only a
    caller that has read and tokenized the request can route it by its prefix (serve.<id>.
    router); the kernel (SO_REUSEPORT) and Serve's proxy pick a replica before the body."""
    deploy = config.deploy
    if deploy.ingress == "separate" or len(config.llms) != 1:
        return None
    module_id, module = next(iter(config.llms.items()))
    if deploy.ingress == "auto" and (deploy.ingress_replicas != 1 or several_replicas(module)):
        return None
    return module_id


def several_replicas(module: LLMModule) -> bool:
    """Whether the module's engine can have more than one replica (fixed or autoscaled)."""
    res = module.resources
    return max(res.num_replicas, res.max_replicas or 0) > 1


def ingress_autoscales(config: Config) -> bool:
    """Whether the replicas that serve HTTP scale with load (Ray Serve autoscaling)."""
    local = ingress_in_engine(config)
    return local is not None and config.llms[local].resources.autoscaling


def direct_http(config: Config) -> bool:
    """Whether the ingress replicas serve HTTP themselves (deploy.http_server), not Serve's proxy."""
    mode = config.deploy.http_server
    if mode != "auto":
        return mode == "replicas"
    return not config.experiment.runner.hostfile and not ingress_autoscales(config)


def engine_core_mode(module: LLMModule) -> CoreMode:
    """Where each replica's step loop runs: with shard workers (TP x PP > 1) the replica
    drives them from a thread of its own, else a child process unless asked otherwise."""
    if module.engine_core != "auto":
        return module.engine_core
    return "thread" if module.world_size > 1 else "process"


def served_names(module_id: str, module: LLMModule) -> list[str]:
    """`model` values routed to this module: model_name (default: the model directory's
    name, or the GGUF file's without .gguf)."""
    if module.model_name:
        return [module.model_name]
    model = Path(str(module.engine_args.get("model", module_id)))
    return [(model.stem if model.suffix == ".gguf" else model.name) or module_id]


def engine_args_for(module: LLMModule) -> EngineArgs:
    """The EngineArgs the engine deployment is built with (placement fields set apart)."""
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in module.engine_args.items() if k in known})


def uses_gpu(module: LLMModule, hosts: list[Host]) -> bool:
    """engine_args.device, with `auto` meaning GPUs when any host has one."""
    device = str(module.engine_args.get("device", "auto"))
    if device == "auto":
        return any(h.num_gpus for h in hosts)
    return device.startswith("cuda")
