"""SiLU-and-multiply for gated MLPs: x = [gate | up] along the last dim -> silu(gate) * up."""
import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
