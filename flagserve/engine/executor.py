"""Executors: what runs the model for the engine, one StepInput in, the sampled tokens out.

TP = PP = 1 runs the ModelRunner in the engine's own process (no Ray, nothing pickled: what
the CPU benchmarks measure). Larger layouts run one shard worker per device under Ray
(ray_executor.py). Either way the engine's block manager is the single source of truth: the
KV block count is decided here, once, from what every shard can hold.
"""
from __future__ import annotations

from typing import Protocol

from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.model_runner import ModelRunner
from flagserve.engine.step_input import StepInput
from flagserve.layers.sampler import DeviceSamples, SamplerOutput
from flagserve.models.config import ModelConfig


class Executor(Protocol):
    num_kv_blocks: int

    def execute(self, step: StepInput) -> SamplerOutput | None: ...

    # Async scheduling (EngineArgs allows it in-process only): launch(step) -> DeviceSamples

    @property
    def forward_seconds(self) -> float: ...  # model time of the sampling shard, for stats

    def shutdown(self) -> None: ...


def decide_kv_blocks(args: EngineArgs, capacities: list[int], max_model_len: int, cuda: bool) -> int:
    """num_kv_blocks if given, else the smallest shard's capacity; it must hold one full
    sequence (a longer one could never be scheduled: preempted by its own growth, forever)."""
    blocks = args.num_kv_blocks or min(capacities)
    if blocks * args.block_size < max_model_len:
        key = ("num_kv_blocks" if args.num_kv_blocks else
                     "gpu_memory_utilization" if cuda else "cpu_kv_cache_space_gib")
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {args.block_size} tokens, "
            f"{blocks * args.block_size} tokens, fewer than max_model_len={max_model_len}: lower "
            f"max_model_len, or raise {key}")
    return blocks


class InProcessExecutor:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...]):
        self.runner = ModelRunner(args, cfg, max_model_len, eos_token_ids)
        self.num_kv_blocks = decide_kv_blocks(args, [self.runner.kv_capacity_blocks()], max_model_len,
                                              self.runner.device.type == "cuda")
        self.runner.allocate_kv_cache(self.num_kv_blocks)

    def execute(self, step: StepInput) -> SamplerOutput | None:
        return self.runner.execute(step)

    def launch(self, step: StepInput) -> DeviceSamples | None:
        """Async scheduling: the step queued on the device, its samples to come (host())."""
        return self.runner.execute(step, defer=True)

    @property
    def forward_seconds(self) -> float:
        return self.runner.forward_seconds

    def shutdown(self) -> None:
        pass


def make_executor(args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                  eos_token_ids: tuple[int, ...]) -> Executor:
    args.check_parallelism(cfg)
    if args.world_size == 1:
        return InProcessExecutor(args, cfg, max_model_len, eos_token_ids)
    from flagserve.engine.ray_executor import RayExecutor  # Ray only where shards need it
    return RayExecutor(args, cfg, max_model_len, eos_token_ids)
