"""FlagServe's compute kernels: a Triton kernel and a plain-torch reference per op family.

Layers never import an implementation directly: they receive a `KernelOps` from
`get_ops(backend, device)`, so one engine can run the reference on CPU and Triton on CUDA.
The names load lazily: the config checks read kernels.env (the engine's settings) without
paying for torch.
"""
from importlib import import_module

__all__ = ["KernelOps", "get_ops", "resolve_backend"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module("kernels.backend"), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
