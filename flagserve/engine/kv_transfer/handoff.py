"""What a prefill engine hands a decode engine for one request, besides the KV blocks.

Plain data (lists, numbers, bytes, SamplingParams), so it crosses Ray or a pipe as is. The KV
itself never travels here: it goes engine to engine over a KVTransport, named by `source`.
"""
from __future__ import annotations

from dataclasses import dataclass

from flagserve.engine.outputs import SampleLogprobs
from flagserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVLayout:
    """Shape and type of one block of K (or V) in every layer; both engines must agree."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # str(torch.dtype), e.g. "torch.float32"


@dataclass
class SeqHandoff:
    index: int  # among the request's n outputs
    token_ids: list[int]  # prompt + first token
    seed: int | None
    # The seeded generator's state after the first token (torch.Generator.get_state bytes):
    # the decode side resumes the same random stream. None for unseeded sequences.
    generator_state: bytes | None
    num_cached_tokens: int  # prefix-cache hits on the prefill side (reported, not transferred)
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    # This sequence's block table as indices into the request's transferred blocks; empty for
    # a sequence that finished with its first token (it needs no KV).
    block_indices: list[int]


@dataclass
class RequestHandoff:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqHandoff]
    num_computed_tokens: int  # tokens whose K/V are transferred: the prompt
    num_blocks: int  # distinct blocks transferred (sequences of n > 1 share prompt blocks)
    layout: KVLayout
    source: str  # the prefill engine's transport endpoint
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    priority: int = 0  # the request's (scheduling_policy "priority" on the decode side too)

    @property
    def block_uses(self) -> list[int]:
        """How many sequences use each transferred block (its reference count)."""
        uses = [0] * self.num_blocks
        for seq in self.seqs:
            for i in seq.block_indices:
                uses[i] += 1
        return uses
