"""Triton SiLU-and-multiply: out = silu(x[..., :I]) * x[..., I:], rounded like the reference."""
import torch
import triton
import triton.language as tl

from kernels._triton_utils import last_dim_contiguous


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # F.silu rounds to the input dtype before the multiply; do the same.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = last_dim_contiguous(x).reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x2, out, x2.stride(0), inter,
                                                          BLOCK=block, num_warps=4)
    return out
