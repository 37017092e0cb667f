"""A shard worker: one Ray actor per device, holding one TP x PP slice of a model replica.

It joins the replica's torch.distributed group, loads only its own weights, allocates the KV
cache of its own layers and KV heads, and then runs ModelRunner.execute on every StepInput
the engine sends. Only the sampling shard (last stage, TP rank 0) returns tokens.
"""
from __future__ import annotations

import os
import socket

from flagserve.distributed.parallel_state import init_parallel
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.model_runner import ModelRunner
from flagserve.engine.step_input import StepInput
from flagserve.layers.sampler import SamplerOutput
from flagserve.models.config import ModelConfig


def _interface_of(ip: str) -> str | None:
    """The network interface holding `ip`: gloo must listen there, not where the hostname points."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


class ShardWorker:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], rank: int):
        self.args, self.cfg, self.rank = args, cfg, rank
        self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
        self.runner: ModelRunner | None = None

    def rendezvous_address(self) -> str:
        """Rank 0 only: tcp://<this node's IP>:<a free port> for torch.distributed."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def init(self, init_method: str) -> int:
        """Join the group, load this shard; returns how many KV blocks it can hold."""
        import ray
        import torch
        cuda = self.args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(0)  # Ray made the bundle's GPU the only visible one
        elif "GLOO_SOCKET_IFNAME" not in os.environ:
            iface = _interface_of(ray.util.get_node_ip_address())
            if iface:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        par = init_parallel(self.rank, self.args.tensor_parallel_size,
                            self.args.pipeline_parallel_size, init_method, "nccl" if cuda else "gloo")
        self.runner = ModelRunner(self.args, self.cfg, self.max_model_len, self.eos_token_ids, par)
        return self.runner.kv_capacity_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, step: StepInput) -> tuple[SamplerOutput | None, float] | None:
        """(sampled tokens, forward seconds so far) on the sampling shard, None elsewhere."""
        out = self.runner.execute(step)
        return (out, self.runner.forward_seconds) if self.runner.par.samples else None

    def shutdown(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
