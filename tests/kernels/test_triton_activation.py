"""SiLU-and-multiply against the reference (same roundings; exp may differ by 1 ulp)."""
import pytest
import torch
from kernel_cases import DEVICE, DTYPES

from kernels.activation import silu_and_mul_torch
from kernels.triton_activation import silu_and_mul_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 88), (2, 3, 2 * 64), (3, 2 * 3000)])
def test_silu_and_mul(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(DEVICE, dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, silu_and_mul_torch(x), atol=atol, rtol=rtol)
