"""Where every engine shard goes: TP ranks packed on one host, PP stages first-fit over hosts.

Pure function of the config and the hosts; `plan` prints it and the multi-host runner turns
it into placement-group bundles.
"""
from __future__ import annotations

from dataclasses import dataclass

from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config
from flagserve.config.validate import uses_gpu


@dataclass
class ShardPlacement:
    module_id: str
    replica: int
    stage: int  # pipeline stage
    host: str
    devices: list[int]  # GPU indices on the host, one per TP rank; [] on CPU


def place(config: Config, hosts: list[Host]) -> list[ShardPlacement]:
    free = {h.address: list(range(h.num_gpus)) for h in hosts}
    out = []
    for module_id, module in config.llms.items():
        res = module.resources
        replicas = max(res.min_replicas or 1, 1) if res.autoscaling else res.num_replicas
        gpu = uses_gpu(module, hosts)
        tp = module.tensor_parallel_size
        for replica in range(replicas):
            for stage in range(module.pipeline_parallel_size):
                if not gpu:
                    out.append(ShardPlacement(module_id, replica, stage, hosts[0].address, []))
                    continue
                host = next((h for h in hosts if len(free[h.address]) >= tp), None)
                if host is None:
                    raise ConfigError(f"serve.{module_id}.engine_args.tensor_parallel_size",
                                      f"replica {replica} stage {stage} needs {tp} GPUs on one "
                                      "host and no host has that many left",
                                      "lower tensor_parallel_size or num_replicas, or add hosts")
                devices, free[host.address] = free[host.address][:tp], free[host.address][tp:]
                out.append(ShardPlacement(module_id, replica, stage, host.address, devices))
    return out
