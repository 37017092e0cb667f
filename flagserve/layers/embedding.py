"""Vocabulary embedding and LM head, split over tensor-parallel ranks by vocabulary range."""
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flagserve.layers.cpu_matmul import PackedWeight, pack_weight
from flagserve.layers.greedy_head import GreedyHead, greedy_head_for
from kernels.sampling import apply_token_bitmask_torch


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp_size - 1) // tp_size
        self.start = tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.shard_size]
        param.data[:rows.shape[0]].copy_(rows)  # the last shard may be padded with zeros

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y, group=self.tp_group)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    packed: PackedWeight | None = None  # the kernel's copy of weight (cpu_matmul.py), once packed
    greedy_head: GreedyHead | None = None  # where all-greedy steps skip the logits (greedy_head.py)

    def pack_for_cpu(self, mode: Literal["native", "onednn"]) -> None:
        """Multiply by a packed copy of the weight from now on. The dense weight stays: with
        tied embeddings it is the embedding's."""
        self.packed = pack_weight(self.weight, mode)
        self.greedy_head = greedy_head_for(self.weight, self.vocab_size, mode, self.tp_size)

    def greedy(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor | None:
        """[N] int64: the argmax of each row of forward(hidden) (among the tokens `bitmask`
        allows: a grammar's, as the sampler applies it), or None where this head has no
        cheaper way to it than the logits."""
        if self.greedy_head is None:
            return None
        tokens = self.greedy_head(hidden, bitmask)
        if bool((lost := tokens < 0).any()):  # a logit not finite: torch.argmax's answer
            logits = self.forward(hidden[lost]).float()
            if bitmask is not None:
                logits = apply_token_bitmask_torch(logits, bitmask[lost])
            tokens[lost] = logits.argmax(-1)
        return tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> logits [N, vocab_size] in the model's dtype on TP rank 0, the rank
        that samples; None on the other ranks (gathering the vocabulary anywhere else is wasted
        traffic). The sampler widens them where it computes on them: a greedy batch's argmax
        needs no fp32 copy of the whole vocabulary."""
        logits = F.linear(hidden, self.weight) if self.packed is None else self.packed(hidden, None)
        if self.tp_size > 1:
            dst = dist.get_global_rank(self.tp_group, 0)
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, dst=dst, group=self.tp_group)
            if parts is None:
                return None
            logits = torch.cat(parts, dim=-1)
        return logits[:, :self.vocab_size]
