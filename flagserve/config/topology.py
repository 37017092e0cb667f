"""Derived facts of a deployment: every `auto` of the config resolved, in one place.

Which module's replicas serve HTTP and how HTTP reaches them, where each engine's step loop
runs, which `model` names route to it, the EngineArgs it is built with, GPU or CPU. The
planner, the runners and the Ray Serve app all ask here, so they cannot disagree;
validate.py only checks that the answers are possible.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule, ResourcesConfig, Role, ScaleMetric
from flagserve.engine.core.interface import CoreMode
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.kv_budget import default_batched_tokens


def ingress_in_engine(config: Config) -> str | None:
    """The LLM module whose engine replicas also serve HTTP (deploy.ingress), or None.

    `auto` keeps the ingress out of the engine when the engine has several replicas: only a
    caller that has read and tokenized the request can route it by its prefix (serve.<id>.
    router); the kernel (SO_REUSEPORT) and Serve's proxy pick a replica before the body."""
    deploy = config.deploy
    if deploy.ingress == "separate" or len(config.llms) != 1:
        return None
    module_id, module = next(iter(config.llms.items()))
    if module.disaggregation is not None:  # the ingress carries the handoff between two deployments
        return None
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
        return [module.model_name] if isinstance(module.model_name, str) else module.model_name
    model = Path(str(module.engine_args.get("model", module_id)))
    return [(model.stem if model.suffix == ".gguf" else model.name) or module_id]


def engine_args_for(module: LLMModule) -> EngineArgs:
    """The module's EngineArgs (placement fields set apart)."""
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in module.engine_args.items() if k in known})


def served_engine_args(module: LLMModule, hosts: list[Host]) -> EngineArgs:
    """The EngineArgs an engine deployment is built with: engine_args_for(module), and with
    chunked prefill and no step budget set, a served engine's default (kv_budget.py)."""
    args = engine_args_for(module)
    if args.max_num_batched_tokens is None and args.enable_chunked_prefill:
        budget = default_batched_tokens(uses_gpu(module, hosts), served=True)
        args = dataclasses.replace(args, max_num_batched_tokens=budget)
    return args


def uses_gpu(module: LLMModule, hosts: list[Host]) -> bool:
    """engine_args.device, with `auto` meaning GPUs when any host has one."""
    device = str(module.engine_args.get("device", "auto"))
    if device == "auto":
        return any(h.num_gpus for h in hosts)
    return device.startswith("cuda")


ROLES: tuple[Role, ...] = ("prefill", "decode")


def role_module(module: LLMModule, role: Role) -> LLMModule:
    """One role of a disaggregated module as a module of its own: the module's engine_args
    with the role's on top, the role's replicas and resources. Plan, placement and the app
    size and place it like any engine."""
    rc = getattr(module.disaggregation, role)
    res = rc.resources
    # A decode replica receives the prompt's KV whatever its own prefix cache holds: its
    # requests are routed by load; prefix affinity (serve.<id>.router) is the prefill role's.
    router = module.router if role == "prefill" else \
        dataclasses.replace(module.router, strategy="least_loaded")
    return dataclasses.replace(
        module, engine_args={**module.engine_args, **rc.engine_args}, disaggregation=None,
        router=router, resources=ResourcesConfig(num_replicas=rc.num_replicas,
                                                 min_replicas=rc.min_replicas,
                                                 max_replicas=rc.max_replicas,
                                                 num_cpus=res.num_cpus, num_gpus=res.num_gpus,
                                                 max_ongoing_requests=res.max_ongoing_requests))


@dataclass(frozen=True)
class RoleScaling:
    """What an autoscaled role scales on: Serve keeps sum(metric) / target replicas."""
    metric: ScaleMetric
    target: float  # per replica


def role_scaling(module: LLMModule, role: Role, hosts: list[Host]) -> RoleScaling | None:
    """The load a role's replicas are autoscaled on, or None for a fixed number of them."""
    rc = getattr(module.disaggregation, role)
    if rc.min_replicas is None and rc.max_replicas is None:
        return None
    args = served_engine_args(role_module(module, role), hosts)
    if role == "decode":
        return RoleScaling("running_requests", rc.target_running_requests or args.max_num_seqs)
    # Without chunked prefill a step's budget is no setting; the served default sizes the queue.
    batch = args.max_num_batched_tokens or default_batched_tokens(uses_gpu(module, hosts), served=True)
    return RoleScaling("queued_prompt_tokens", rc.target_queued_tokens or 2 * batch)


@dataclass
class EngineGroup:
    """One engine deployment of the graph: <id>-engine, or <id>-prefill and <id>-decode."""
    name: str
    module_id: str
    module: LLMModule  # for a role: role_module()
    role: Role | None
    host: str | None = None  # the role's pinned host (disaggregation.<role>.host)


def engine_groups(config: Config) -> list[EngineGroup]:
    groups = []
    for mid, module in config.llms.items():
        if module.disaggregation is None:
            groups.append(EngineGroup(f"{mid}-engine", mid, module, None))
        else:
            groups += [EngineGroup(f"{mid}-{role}", mid, role_module(module, role), role,
                                   getattr(module.disaggregation, role).host)
                       for role in ROLES]
    return groups
