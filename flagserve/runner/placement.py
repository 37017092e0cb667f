"""Where every engine shard goes: TP ranks packed on one host, PP stages first-fit over hosts.

Pure function of the config and the hosts; `plan` prints it and the multi-host runner turns
it into placement-group bundles.
"""
from __future__ import annotations

from dataclasses import dataclass

from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.config.topology import engine_groups, uses_gpu


@dataclass
class ShardPlacement:
    module_id: str
    engine: str  # its deployment: <id>-engine, or <id>-prefill / <id>-decode
    replica: int
    stage: int  # pipeline stage
    host: str
    devices: list[int]  # GPU indices on the host, one per TP rank; [] on CPU


def place(config: Config, hosts: list[Host]) -> list[ShardPlacement]:
    """Each replica's stages in host order, first fit: a stage's TP ranks on one host.

    Capacity is a host's slots (GPUs, or CPUs on `type=cpu` hosts: each CPU shard takes one).
    Without a hostfile, CPU shards all run on this host whatever its core count."""
    multihost = bool(config.experiment.runner.hostfile)
    free = {h.address: list(range(h.slots)) for h in hosts}
    out = []
    for group in engine_groups(config):  # each role of a disaggregated module on its own
        module_id, module = group.module_id, group.module
        res = module.resources
        replicas = max(res.min_replicas or 1, 1) if res.autoscaling else res.num_replicas
        gpu = uses_gpu(module, hosts)
        tp = module.tensor_parallel_size
        for replica in range(replicas):
            for stage in range(module.pipeline_parallel_size):
                if not gpu and not multihost:
                    out.append(ShardPlacement(module_id, group.name, replica, stage, hosts[0].address, []))
                    continue
                fits = [h for h in hosts if (h.num_gpus or not gpu) and len(free[h.address]) >= tp
                        and group.host in (None, h.address)]  # a role may be pinned
                if not fits:
                    kind = "GPUs" if gpu else "CPU slots (type=cpu hosts)"
                    raise ConfigError(f"serve.{module_id}.engine_args.tensor_parallel_size",
                                      f"replica {replica} stage {stage} needs {tp} {kind} on one "
                                      "host and no host has that many left",
                                      "lower tensor_parallel_size or num_replicas, or add hosts")
                host = fits[0]
                devices, free[host.address] = free[host.address][:tp], free[host.address][tp:]
                out.append(ShardPlacement(module_id, group.name, replica, stage, host.address,
                                          devices if gpu else []))
    return out


def stage_hosts(config: Config, hosts: list[Host], module_id: str) -> list[str] | None:
    """The host of each pipeline stage of `module_id`, for the engine's placement group
    (EngineArgs.placement_hosts), when a hostfile is used and every replica is placed alike
    (one Serve deployment gives all its replicas the same arguments); else None: Ray packs."""
    if not config.experiment.runner.hostfile:
        return None
    plans: dict[int, list[str]] = {}
    for s in place(config, hosts):
        if s.module_id == module_id:
            plans.setdefault(s.replica, []).append(s.host)
    distinct = {tuple(p) for p in plans.values()}
    return list(distinct.pop()) if len(distinct) == 1 else None
