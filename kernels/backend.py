"""Chooses the implementation of every op for one engine: Triton or the torch reference."""
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.activation import silu_and_mul_torch
from kernels.decode_attention import paged_decode_attention_torch
from kernels.kv_store import store_kvcache_torch
from kernels.prefill_attention import paged_prefill_attention_torch
from kernels.rms_norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.rotary import rotary_embedding_torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kvcache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable


TORCH_OPS = KernelOps(
    name="torch",
    store_kvcache=store_kvcache_torch,
    paged_decode_attention=paged_decode_attention_torch,
    paged_prefill_attention=paged_prefill_attention_torch,
    rms_norm=rms_norm_torch,
    fused_add_rms_norm=fused_add_rms_norm_torch,
    rotary_embedding=rotary_embedding_torch,
    silu_and_mul=silu_and_mul_torch,
)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "torch"  # until the Triton kernels land, the reference runs everywhere
    if backend == "triton":
        raise ValueError("attention_backend='triton' is not available yet; use 'torch' or 'auto'")
    return backend


def get_ops(backend: str, device: torch.device) -> KernelOps:
    resolve_backend(backend, device)
    return TORCH_OPS
