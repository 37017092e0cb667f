"""How one flattened batch maps onto the paged KV cache (built by the model runner per step).

The tensors are views of static buffers (engine/input_buffers.py). A decode-only step may be
padded to a CUDA-graph bucket: padded rows have slot -1, seq_len 1 over block 0, and are
counted in num_decode_tokens; kernels must treat them like any decode and never write them.
"""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Sequences with exactly one new token come first ("decodes"), then prefill chunks.
    num_decode_tokens: int  # the decodes: one new token each, the first rows of the batch
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = padding
    seq_lens: torch.Tensor  # [batch] int32: tokens in the cache after this step
    block_tables: torch.Tensor  # [batch, width] int32, contiguous; entries past a sequence's
    # blocks are 0; width is the step's longest table, or every block of max_model_len when padded
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32: prefill query offsets (from 0)
    # [num_decode_tokens] int32: the decodes by descending seq_len, the order the decode kernel
    # launches them in (kernels/triton_decode_attention.py); None where the kernel takes none
    decode_order: torch.Tensor | None = None
    # No decodes and nothing cached before any prefill: every sequence is a whole prompt
    whole_prompts: bool = False
