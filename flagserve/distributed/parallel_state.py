"""Where one shard sits in the TP x PP grid, and the process groups it talks over.

Global rank = pp_rank * tp_size + tp_rank: the TP ranks of a stage are consecutive, so a
stage's ranks are one placement-group bundle range and can be packed on one host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None  # None when tp_size == 1: no collectives

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """The one shard that runs the sampler: last stage, TP rank 0."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def prev_rank(self) -> int:  # the same TP rank one stage earlier
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str,
                  backend: str) -> ParallelContext:
    """Join the shard group (every rank calls this) and build one TP group per stage."""
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    # new_group is collective: every rank creates every stage's group, in the same order.
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == pp_rank and tp_size > 1:
            tp_group = group
    return ParallelContext(tp_rank, tp_size, pp_rank, pp_size, tp_group)
