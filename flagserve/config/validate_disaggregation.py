"""Checks of serve.<id>.disaggregation: what the prefill -> decode handoff needs of both roles.

The KV blocks cross from one engine's cache into the other's as they are, so whatever shapes
them must be the module's, the same on both sides. The rest are limits of the transport as it
stands (README, Prefill/decode disaggregation): engines of TP = PP = 1. Each role has any
number of replicas (xPyD): every decode replica links to each prefill replica on first use,
on one host or across a hostfile's (a role may be pinned to one of them).
"""
from __future__ import annotations

from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule, Role, RoleConfig
from flagserve.config.topology import ROLES, engine_args_for, role_module, uses_gpu

# EngineArgs that shape a KV block or what the blocks mean: one value for both roles.
SHARED_ARGS = ("model", "tokenizer", "dtype", "device", "block_size", "tensor_parallel_size",
               "pipeline_parallel_size")


def check_disaggregation(config: Config, module_id: str, module: LLMModule,
                         hosts: list[Host]) -> None:
    path = f"serve.{module_id}"
    if "kv_transfer" in module.engine_args:
        fix = (f"remove it: serve.{module_id}.disaggregation sets each role's" if module.disaggregation
               else f"remove it, or split the module with serve.{module_id}.disaggregation")
        raise ConfigError(f"{path}.engine_args.kv_transfer", "is set by the serving graph", fix)
    if module.disaggregation is None:
        return
    res = module.resources
    if res.num_replicas != 1 or res.autoscaling:
        raise ConfigError(f"{path}.resources.num_replicas",
                          "a disaggregated module has replicas per role",
                          f"set {path}.disaggregation.prefill.num_replicas and "
                          f"{path}.disaggregation.decode.num_replicas instead")
    for role in ROLES:
        _check_role(f"{path}.disaggregation.{role}", getattr(module.disaggregation, role))
        _check_role_engine_args(f"{path}.disaggregation.{role}", role_module(module, role))
        _check_scaling(f"{path}.disaggregation.{role}", role, getattr(module.disaggregation, role))
        _check_host(config, f"{path}.disaggregation.{role}.host",
                    getattr(module.disaggregation, role).host, hosts)
    if module.world_size > 1:
        raise ConfigError(f"{path}.engine_args.tensor_parallel_size",
                          "prefill/decode disaggregation needs TP = PP = 1 for now (the KV of "
                          "shard workers is not reachable by the transfer yet)",
                          f"set tensor_parallel_size and pipeline_parallel_size to 1, or remove "
                          f"{path}.disaggregation")
    if module.disaggregation.kv_transfer == "nccl" and not uses_gpu(module, hosts):
        raise ConfigError(f"{path}.disaggregation.kv_transfer", "nccl moves CUDA tensors and "
                          "this module's engines run on CPU", "use auto (gloo on CPU) or gloo")
    if config.deploy.ingress == "engine":
        raise ConfigError("experiment.runner.deploy.ingress",
                          f"`engine` serves HTTP from the engine replicas; {path} is split into "
                          "prefill and decode replicas, and the ingress carries each request "
                          "from one to the other", "set experiment.runner.deploy.ingress=auto "
                          "(or separate)")


def _check_role(path: str, role: RoleConfig) -> None:
    if isinstance(role.num_replicas, bool) or role.num_replicas < 1:
        raise ConfigError(f"{path}.num_replicas", f"must be >= 1, got {role.num_replicas}",
                          "e.g. 1")
    for key in SHARED_ARGS + ("kv_transfer",):
        if key in role.engine_args:
            where = path.rsplit(".", 2)[0]  # serve.<id>
            raise ConfigError(f"{path}.engine_args.{key}",
                              "must be the same for both roles (it shapes the KV blocks "
                              "that move between them)" if key != "kv_transfer"
                              else "is set by the serving graph",
                              f"remove it here; set {where}.engine_args.{key} for both"
                              if key != "kv_transfer" else "remove it")
    for name in ("num_cpus", "num_gpus"):
        value = getattr(role.resources, name)
        if value is not None and value < 0:
            raise ConfigError(f"{path}.resources.{name}", f"must be >= 0, got {value}", "e.g. 1")
    if (ongoing := role.resources.max_ongoing_requests) is not None and ongoing < 1:
        raise ConfigError(f"{path}.resources.max_ongoing_requests", "must be >= 1", "e.g. 256")


def _check_role_engine_args(path: str, module: LLMModule) -> None:
    """The role's engine_args over the module's, as its engines are built with them."""
    try:
        engine_args_for(module)
    except (ValueError, TypeError) as err:
        key, _, message = str(err).removeprefix("EngineArgs.").partition(" ")
        raise ConfigError(f"{path}.engine_args.{key}", message or str(err),
                          "see `EngineArgs` in flagserve/engine/engine_args.py") from None


# Each role's autoscaling target: its key, what it counts, its default (topology.role_scaling)
TARGETS = {"decode": ("target_running_requests", "running requests", "max_num_seqs"),
           "prefill": ("target_queued_tokens", "queued prompt tokens",
                       "2 x max_num_batched_tokens")}


def _check_scaling(path: str, role: Role, rc: RoleConfig) -> None:
    lo, hi = rc.min_replicas, rc.max_replicas
    target, counts, default = TARGETS[role]
    other = next(key for r, (key, _, _) in TARGETS.items() if r != role)
    if getattr(rc, other) is not None:
        raise ConfigError(f"{path}.{other}", f"the {role} role scales on {counts}",
                          f"use {path}.{target}")
    if (lo is None) != (hi is None):
        raise ConfigError(f"{path}.{'max' if hi is None else 'min'}_replicas",
                          "autoscaling needs both min_replicas and max_replicas",
                          "set both, or neither for a fixed num_replicas")
    if lo is None:
        if getattr(rc, target) is not None:
            raise ConfigError(f"{path}.{target}", "is the autoscaling target, and the role "
                              "is not autoscaled", "set min_replicas and max_replicas too, "
                              "or remove it")
        return
    # At zero, a request would wait for a replica to load its model (tens of seconds).
    if isinstance(lo, bool) or isinstance(hi, bool) or not 1 <= lo <= hi:
        raise ConfigError(f"{path}.min_replicas", "need 1 <= min_replicas <= max_replicas, "
                          f"got {lo}..{hi} (a role at zero replicas stalls every request)",
                          "e.g. min_replicas 1, max_replicas 4")
    if (value := getattr(rc, target)) is not None and value <= 0:
        raise ConfigError(f"{path}.{target}", f"must be > 0, got {value}",
                          f"leave it unset for the default ({default})")


def _check_host(config: Config, path: str, host: str | None, hosts: list[Host]) -> None:
    if host is None:
        return
    if not config.experiment.runner.hostfile:  # only the multi-host runner's nodes have it
        raise ConfigError(path, "pins a role to a host of experiment.runner.hostfile, and "
                          "there is none", "remove it (one host: every replica runs here)")
    addresses = [h.address for h in hosts]
    if host not in addresses:
        raise ConfigError(path, f"{host!r} is not a host of the hostfile",
                          f"use one of: {', '.join(addresses)}")
