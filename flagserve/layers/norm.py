"""RMSNorm layer over the kernel ops (plain, or fused with the residual add)."""
import torch
from torch import nn

from kernels import KernelOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
