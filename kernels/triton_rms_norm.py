"""Triton RMSNorm (plain and fused with the residual add), one program per row.

Numerics follow the torch reference (and HF): statistics in fp32, the normalised row rounded
to the input dtype, then multiplied by the weight with the usual dtype promotion. The fused
variant rounds x + residual to the input dtype before normalising, as the reference does.
Both return new tensors (inputs are left untouched) so they are drop-in for the reference.
"""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import last_dim_contiguous, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
                     n1, stride_x0, stride_x1, stride_r0, stride_r1, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i0, i1 = row // n1, row % n1  # rows may be a strided [n0, n1] view (e.g. per-head q/k norm)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i0 * stride_r0 + i1 * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, n1, stride0, stride1) so that row r is at (r // n1) * stride0 + (r % n1) * stride1."""
    x = last_dim_contiguous(x)
    if x.dim() == 1:
        x = x[None]
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rows = x.numel() // hidden
    if rows == 0:
        return out, summed
    xr, n1, sx0, sx1 = _as_rows(x)
    rr, _, sr0, sr1 = _as_rows(residual) if residual is not None else (xr, n1, sx0, sx1)
    block = next_pow2(hidden)
    assert block <= 65536, "rows longer than 64K elements need a looped kernel"
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _rms_norm_kernel[(rows,)](
        xr, rr, weight, out, summed if summed is not None else out,
        n1, sx0, sx1, sr0, sr1, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps)
    return out, summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    normed, summed = _launch(x, residual, weight, eps)
    return normed, summed
