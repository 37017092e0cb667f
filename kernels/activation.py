"""SiLU-and-multiply for gated MLPs: x = [gate | up] along the last dim -> silu(gate) * up."""
import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def __getattr__(name: str):
    # The Triton version (triton_activation.py) is imported on first use only: importing the
    # reference must not import triton, which fixes interpreter mode at kernel definition.
    if name in ("silu_and_mul_triton",):
        from kernels import triton_activation
        return getattr(triton_activation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
