"""The Triton implementation of every op, as one KernelOps (importing this imports triton)."""
from kernels.backend import KernelOps
from kernels.sampling import apply_token_bitmask_torch, argmax_torch, lse_and_ranks_torch
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_decode_attention import paged_decode_attention_triton
from kernels.triton_prefill_attention import (
    paged_prefill_attention_triton,
    prefill_attention_triton,
)
from kernels.triton_rms_norm import fused_add_rms_norm_triton, rms_norm_triton
from kernels.triton_rotary_store import rotary_store_kvcache_triton

TRITON_OPS = KernelOps(
    name="triton",
    rotary_store_kvcache=rotary_store_kvcache_triton,
    paged_decode_attention=paged_decode_attention_triton,
    paged_prefill_attention=paged_prefill_attention_triton,
    rms_norm=rms_norm_triton,
    fused_add_rms_norm=fused_add_rms_norm_triton,
    silu_and_mul=silu_and_mul_triton,
    apply_token_bitmask=apply_token_bitmask_torch,  # one add: no kernel of its own needed
    argmax=argmax_torch,
    lse_and_ranks=lse_and_ranks_torch,
    orders_decodes=True,
    prefill_attention=prefill_attention_triton,
)


def check_interpreted() -> None:
    """On CPU the kernels only run if they were decorated in interpreter mode, which triton
    decides once, when the kernel module is imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton_rms_norm import _rms_norm_kernel
    if not isinstance(_rms_norm_kernel, InterpretedFunction):
        raise ValueError("the Triton kernels were imported before TRITON_INTERPRET=1 was set, so "
                         "they cannot run on CPU; set TRITON_INTERPRET=1 before starting Python")
