"""RMSNorm, plain and fused with the residual add (computed in fp32 like HF transformers)."""
import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def __getattr__(name: str):
    # The Triton version (triton_rms_norm.py) is imported on first use only: importing the
    # reference must not import triton, which fixes interpreter mode at kernel definition.
    if name in ("rms_norm_triton", "fused_add_rms_norm_triton"):
        from kernels import triton_rms_norm
        return getattr(triton_rms_norm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
