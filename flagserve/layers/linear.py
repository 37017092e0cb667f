"""Linear layers that know how to load (and, with tp_size > 1, slice) their HF weights.

Column-parallel layers split the output dim across tensor-parallel ranks, row-parallel ones
split the input dim and all-reduce the partial sums. With tp_size == 1 they are plain linears.
Fused layers (QKV, gate|up) load each HF projection into its slice of one weight.
On CPU the engine packs the weights for its matmul kernel after loading (pack_for_cpu, cpu_matmul.py).
"""
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flagserve.layers.cpu_matmul import PackedWeight, pack_weight
from kernels import KernelOps


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None  # the kernel's copy of weight, once packed

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded[:])

    def pack_for_cpu(self, mode: Literal["native", "onednn"]) -> None:
        """Multiply by a packed copy of the weight from now on; the dense weight is released
        (nothing reads it after loading)."""
        self.packed = pack_weight(self.weight, mode)
        self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        assert output_size % tp_size == 0, f"output size {output_size} not divisible by TP {tp_size}"
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (gate|up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def silu_and_mul(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """ops.silu_and_mul(self(x)) for [gate; up]; with ops that fuse it into a natively
        packed weight's linear, one pass that never writes the [rows, 2 x intermediate]
        product (the same bits)."""
        fused, packed = ops.packed_silu_and_mul, self.packed
        if fused is None or packed is None or packed.mode != "native":
            return ops.silu_and_mul(self(x))
        return packed.silu_and_mul(x, self.bias, fused)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its own query and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert num_heads % tp_size == 0 and num_kv_heads % tp_size == 0, \
            f"{num_heads} query / {num_kv_heads} KV heads cannot be split over TP {tp_size}"
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, tp_group: dist.ProcessGroup | None = None):
        assert input_size % tp_size == 0, f"input size {input_size} not divisible by TP {tp_size}"
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)
        self.tp_group = tp_group  # the ranks of this pipeline stage (None: the default group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded[:])
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y if self.bias is None else y + self.bias
