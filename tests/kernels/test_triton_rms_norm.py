"""RMSNorm and fused add + RMSNorm against the reference.

Tolerance: same fp32 statistics and the same roundings as the reference; only the order of
the sum of squares differs, which can flip the last bit of a 16-bit result (1 ulp).
"""
import pytest
import torch
from kernel_cases import DEVICE, DTYPES

from kernels.rms_norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.triton_rms_norm import fused_add_rms_norm_triton, rms_norm_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96), (2, 1000)])
def test_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype) * 3
    weight = randn(shape[-1], dtype=dtype, seed=1)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6),
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    # Per-head q norm (Qwen3) runs on a [T, H, D] view of a fused qkv output.
    qkv = randn(5, (4 + 2 + 2) * 32, dtype=dtype)
    q = qkv[:, :4 * 32].view(5, 4, 32)
    weight = randn(32, dtype=dtype, seed=1)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(rms_norm_triton(q, weight, 1e-6), rms_norm_torch(q, weight, 1e-6),
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (4, 3000)])
def test_fused_add_rms_norm(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=2)
    weight = randn(shape[-1], dtype=dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    normed_ref, summed_ref = fused_add_rms_norm_torch(x, residual, weight, 1e-5)
    assert torch.equal(summed, summed_ref)  # one rounded add, as in the reference
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(normed, normed_ref, atol=atol, rtol=rtol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_weight_dtype_promotion():
    x = randn(3, 64, dtype=torch.float16)
    weight = randn(64, dtype=torch.float32, seed=1)
    out = rms_norm_triton(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_torch(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
