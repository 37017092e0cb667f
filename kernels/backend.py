"""Chooses the implementation of every op for one engine: Triton or the torch reference.

Backends: "torch" (the reference, any device), "triton" (our kernels: native on CUDA, through
triton's numpy interpreter on CPU, which needs TRITON_INTERPRET=1 in the environment before
triton is imported) and "auto" (Triton on CUDA when triton imports, torch elsewhere).

The environment variable FLAGSERVE_KERNEL_BACKEND=torch|triton|auto overrides "auto" (an
explicit "torch" or "triton" in the config wins), e.g. to run a CPU engine on the Triton
kernels: `TRITON_INTERPRET=1 FLAGSERVE_KERNEL_BACKEND=triton ...`.

Triton is imported lazily: a torch-only install can import `kernels` and use the reference.
"""
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul_torch
from kernels.decode_attention import paged_decode_attention_torch
from kernels.env import env_flag
from kernels.prefill_attention import paged_prefill_attention_torch
from kernels.rms_norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.rotary_store import rotary_store_kvcache_torch
from kernels.sampling import apply_token_bitmask_torch, argmax_torch, lse_and_ranks_torch

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV = "FLAGSERVE_KERNEL_BACKEND"
INTERPRET_ENV = "TRITON_INTERPRET"


@dataclass(frozen=True)
class KernelOps:
    name: str
    rotary_store_kvcache: Callable  # (q/k norm +) rotary + KV-cache store, fused
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    apply_token_bitmask: Callable  # a grammar's allowed tokens (sampler)
    argmax: Callable  # each row's largest logit (sampler)
    lse_and_ranks: Callable  # each row's log-sum-exp and a token's rank (logprobs)
    # paged_decode_attention works through the sequences in a given order: the engine builds
    # one per step (longest first) for it, and none for the others
    orders_decodes: bool = False
    # Whole prompts over their own K/V rows (q, k, v, cu_seqlens_q, scale), no block table;
    # ops that have it rotate k in place when rotary_store_kvcache is given rotate_k=True
    prefill_attention: Callable | None = None
    # silu_and_mul of a [gate; up] linear on a natively packed weight (x rows, packed data,
    # out_features, bias), in one pass: only the native CPU ops have it
    packed_silu_and_mul: Callable | None = None


TORCH_OPS = KernelOps(
    name="torch",
    rotary_store_kvcache=rotary_store_kvcache_torch,
    paged_decode_attention=paged_decode_attention_torch,
    paged_prefill_attention=paged_prefill_attention_torch,
    rms_norm=rms_norm_torch,
    fused_add_rms_norm=fused_add_rms_norm_torch,
    silu_and_mul=silu_and_mul_torch,
    apply_token_bitmask=apply_token_bitmask_torch,
    argmax=argmax_torch,
    lse_and_ranks=lse_and_ranks_torch,
)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return env_flag(INTERPRET_ENV)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend ("torch" or "triton") for a requested one on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("the 'triton' kernel backend needs the triton package; "
                             "install it or use the 'torch' backend")
        if device.type != "cuda" and not interpreter_enabled():
            raise ValueError(f"the 'triton' kernel backend on device {device.type!r} runs the "
                             f"Triton interpreter: set {INTERPRET_ENV}=1 in the environment "
                             "before triton is imported (i.e. before starting Python)")
    return backend


def get_ops(backend: str, device: torch.device | str) -> KernelOps:
    if resolve_backend(backend, device) == "torch":
        return TORCH_OPS
    from kernels.triton_ops import TRITON_OPS, check_interpreted
    if torch.device(device).type != "cuda":
        check_interpreted()
    return TRITON_OPS
