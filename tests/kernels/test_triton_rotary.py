"""Rotary embedding (neox, in place) against the reference, on strided q/k views.

The kernel rounds exactly where the reference does, so results agree to the last bit except
where fused multiply-add or libm differences flip one (fp32 1e-6, 16-bit 1 ulp).
"""
import math

import pytest
import torch
from kernel_cases import DEVICE, DTYPES

from kernels.rotary import rotary_embedding_torch
from kernels.triton_rotary import rotary_embedding_triton

TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def cos_sin_cache(head_dim: int, max_position: int) -> torch.Tensor:
    # Llama-3-like: base 500000, low frequencies divided by 8.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    inv_freq = torch.where(2 * math.pi / inv_freq > 2048, inv_freq / 8, inv_freq)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 80), (16, 2, 128)])
def test_rotary_in_place_on_qkv_views(num_q_heads, num_kv_heads, head_dim, dtype):
    num_tokens, max_position = 11, 4096
    gen = torch.Generator().manual_seed(0)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)
    cache = cos_sin_cache(head_dim, max_position)

    def views(t):
        q = t[:, :num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
        k = t[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim]
        return q, k.view(num_tokens, num_kv_heads, head_dim)

    ref = qkv.clone()
    rotary_embedding_torch(positions, *views(ref), cache)
    rotary_embedding_triton(positions, *views(qkv), cache)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv, ref, atol=atol, rtol=rtol)  # v part untouched as well
