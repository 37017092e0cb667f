"""The native CPU elementwise kernels (kernels/cpu_native.py) against the torch references."""
import pytest
import torch

from kernels import cpu_native
from kernels.activation import silu_and_mul_torch
from kernels.rms_norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.rotary_store import rotary_store_kvcache_torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")
# float32: the same math in another summation order; 16-bit: one rounding of the output.
TOL = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])


def close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 200])  # 200: past the grain, split over threads
def test_norms(rows, dtype):
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(576, generator=gen).to(dtype)
    close(cpu_native.rms_norm_cpu(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5), dtype)
    got = cpu_native.fused_add_rms_norm_cpu(x, res, weight, 1e-5)
    want = fused_add_rms_norm_torch(x, res, weight, 1e-5)
    for g, w in zip(got, want):
        close(g, w, dtype)


def test_norm_of_strided_rows_falls_back_to_the_reference():
    x = torch.randn(5, 4, 64)[:, :3]  # per-head norms (Qwen3's q/k) on a view
    weight = torch.rand(64)
    close(cpu_native.rms_norm_cpu(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6), torch.float32)


@DTYPES
@pytest.mark.parametrize("rows", [1, 3, 100])
def test_silu_and_mul(rows, dtype):
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)  # wide enough for exp's tails
    close(cpu_native.silu_and_mul_cpu(x), silu_and_mul_torch(x), dtype)


@DTYPES
@pytest.mark.parametrize("tokens", [3, 100])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qwen3-qk-norm"])
def test_rotary_store_matches_reference(tokens, dtype, qk_norm):
    heads, kv_heads, dim, block = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    slots = torch.randperm(8 * block, generator=gen)[:tokens]
    slots[1] = -1  # a padding row: rotated, never stored
    angles = torch.arange(512)[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    norms = {}
    if qk_norm:  # Qwen3: each head normed first (the native norm over head-rows, then fused)
        norms = dict(q_norm_weight=torch.rand(dim, generator=gen).to(dtype),
                     k_norm_weight=torch.rand(dim, generator=gen).to(dtype), eps=1e-6)
    results = []
    for op in (cpu_native.rotary_store_kvcache_cpu, rotary_store_kvcache_torch):
        q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))  # strided views, as the engine's
        caches = [torch.zeros(8, block, kv_heads, dim, dtype=dtype) for _ in range(2)]
        results.append((op(positions, q, k, v, *caches, slots, cos_sin, **norms), *caches))
    for got, want in zip(*results):
        close(got, want, dtype)
