"""How one flattened batch maps onto the paged KV cache (built by the model runner per step)."""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Sequences with exactly one new token come first ("decodes"), then prefill chunks.
    num_decode_tokens: int  # the decodes: one new token each, the first rows of the batch
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = padding
    seq_lens: torch.Tensor  # [batch] int32: tokens in the cache after this step
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32: prefill query offsets (from 0)
