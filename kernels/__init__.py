"""FlagServe's compute kernels: a Triton kernel and a plain-torch reference per op family.

Layers never import an implementation directly: they receive a `KernelOps` from
`get_ops(backend, device)`, so one engine can run the reference on CPU and Triton on CUDA.
"""
from kernels.backend import KernelOps, get_ops, resolve_backend

__all__ = ["KernelOps", "get_ops", "resolve_backend"]
