"""Fused q/k RMSNorm + rotary + KV-cache store against the composed references.

The kernel rounds where the references round, so the caches and the returned query agree to
1 ulp (fp32: 1e-6 relative) and V, a pure copy, exactly. In 16 bits a GPU compiler may keep the
rotation's products in fp32 rather than round each (seen on an H200, 2 of 8,320 elements): the
bound there is the products' rounding plus the result's, per element. q and k are strided views of a fused
qkv output as in the model; slots cross block boundaries and some are padding (-1).
"""
import math

import pytest
import torch
from kernel_cases import DEVICE, DTYPES

from kernels.rms_norm import rms_norm_torch
from kernels.rotary_store import rotary_store_kvcache_torch
from kernels.triton_rotary_store import rotary_store_kvcache_triton

FP32_TOL = (1e-5, 1e-6)
BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION = 16, 6, 4096


def cos_sin_cache(head_dim: int) -> torch.Tensor:
    # Llama-3-like: base 500000, low frequencies divided by 8.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    inv_freq = torch.where(2 * math.pi / inv_freq > 2048, inv_freq / 8, inv_freq)
    freqs = torch.arange(MAX_POSITION).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def make_inputs(num_tokens, hq, hkv, head_dim, dtype, gen):
    qkv = (3 * torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=gen)).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    views = [t.view(num_tokens, -1, head_dim) for t in (q, k, v)]
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[::5] = -1
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    return qkv, views, positions, slots.to(DEVICE), cache


def assert_rotated_close(out, ref, x, positions, table, weight):
    """x: the rows before the norm and rotation; weight: the norm's, or None."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=FP32_TOL[0], rtol=FP32_TOL[1])
        return
    if weight is not None:
        x = rms_norm_torch(x, weight, 1e-6)
    half = x.shape[-1] // 2
    cs = table.index_select(0, positions.long())[:, None, :].to(x.dtype).float().abs()
    x, cos, sin = x.float().abs(), cs[..., :half], cs[..., half:]
    products = torch.cat((x[..., :half] * cos + x[..., half:] * sin,
                          x[..., half:] * cos + x[..., :half] * sin), dim=-1)
    bound = torch.finfo(out.dtype).eps * (products + ref.float().abs())
    excess = (out.float() - ref.float()).abs() - bound
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements over the bound, by {excess.max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm+rope"])
@pytest.mark.parametrize("hq,hkv,head_dim,rotate_k", [(4, 4, 64, False), (8, 2, 80, True),
                                                     (16, 8, 128, False), (16, 8, 128, True)])
def test_matches_reference(hq, hkv, head_dim, rotate_k, qk_norm, dtype):
    gen = torch.Generator().manual_seed(0)
    qkv, (q, k, v), positions, slots, cache = make_inputs(13, hq, hkv, head_dim, dtype, gen)
    weights = {}
    if qk_norm:
        weights = {name: (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype)
                   for name in ("q_norm_weight", "k_norm_weight")}
    table = cos_sin_cache(head_dim)
    ref_caches = [cache.clone(), (-cache).clone()]
    ref_q = rotary_store_kvcache_torch(positions, q.clone(), k.clone(), v, *ref_caches, slots,
                                       table, eps=1e-6, **weights)
    caches = [cache.clone(), (-cache).clone()]
    v_before, q_before, k_before = v.clone(), q.clone(), k.clone()
    out_q = rotary_store_kvcache_triton(positions, q, k, v, *caches, slots, table, eps=1e-6,
                                        rotate_k=rotate_k, **weights)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, inside the qkv output
    assert_rotated_close(out_q, ref_q, q_before, positions, table, weights.get("q_norm_weight"))
    stored = slots >= 0
    blocks, offsets = slots[stored] // BLOCK_SIZE, slots[stored] % BLOCK_SIZE
    assert_rotated_close(caches[0][blocks, offsets], ref_caches[0][blocks, offsets],
                         k_before[stored], positions[stored], table,
                         weights.get("k_norm_weight"))
    untouched = torch.ones(caches[0].shape[:2], dtype=torch.bool, device=DEVICE)
    untouched[blocks, offsets] = False
    assert torch.equal(caches[0][untouched], ref_caches[0][untouched])  # padding slots unwritten
    assert torch.equal(caches[1], ref_caches[1])  # V: a copy, padding slots untouched
    assert torch.equal(v, v_before)
    # rotate_k: k's rows with a slot hold what was stored (prefill_attention reads them)
    assert torch.equal(k[stored], caches[0][blocks, offsets]) == rotate_k
    assert torch.equal(k[~stored], k_before[~stored])


def test_all_padding_and_empty():
    gen = torch.Generator().manual_seed(1)
    _, (q, k, v), positions, _, cache = make_inputs(3, 4, 2, 64, torch.float32, gen)
    k_cache, v_cache = cache.clone(), cache.clone()
    padding = torch.full((3,), -1, device=DEVICE)
    rotary_store_kvcache_triton(positions, q, k, v, k_cache, v_cache, padding, cos_sin_cache(64))
    assert torch.equal(k_cache, cache) and torch.equal(v_cache, cache)
    none = rotary_store_kvcache_triton(positions[:0], q[:0], k[:0], v[:0], k_cache, v_cache,
                                       padding[:0], cos_sin_cache(64))
    assert none.shape[0] == 0
