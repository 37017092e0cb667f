"""Shared cases and builders for the kernel tests (triton-free: safe to import anywhere)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.backend import BACKEND_ENV, INTERPRET_ENV

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter at the repository root, without this process's kernel
    backend switches (the conftest's interpreter switch), plus `env`."""
    clean_env = {k: v for k, v in os.environ.items() if k not in (INTERPRET_ENV, BACKEND_ENV)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**clean_env, "PYTHONPATH": str(REPO), **env}, timeout=timeout)

# (atol, rtol) per dtype for attention outputs compared with the torch reference on the same
# inputs: fp32 is limited by summation order; 16-bit by output rounding (1-2 ulp) and by P
# being rounded to 16 bits before P @ V. Measured on CPU: fp32 <= 1.1e-6, fp16 <= 2e-3.
ATTN_TOL = {torch.float32: (5e-5, 5e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="triton's CPU interpreter computes bf16 wrongly without an error: GPU only")),
]


def make_paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, garbage: float | None = None,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a block table with shuffled physical blocks.

    Every sequence's blocks are scattered (never contiguous or in order); table entries past a
    sequence's last block are 0, the padding value. Block 0 belongs to nobody. With `garbage`,
    every cache row that no sequence owns (block 0, spare blocks, the tail of each last block)
    holds that value, so a kernel that reads past seq_len produces it (NaN: poison).
    """
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    needed = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = needed + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max_blocks + 2, dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for i in range(-(-n // block_size)):
            blk = physical.pop()
            table[b, i] = blk
            valid = min(block_size, n - i * block_size)
            owned[blk * block_size: blk * block_size + valid] = True
    if garbage is not None:
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[~owned] = garbage
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)


def clean(cache: torch.Tensor) -> torch.Tensor:
    """The reference multiplies masked V rows by zero weights, so it needs finite garbage."""
    return torch.nan_to_num(cache, nan=0.0)


def check_prefill(attend, batch: list[tuple[int, int]], group: int, block_size: int,
                  head_dim: int, dtype: torch.dtype, num_kv_heads: int = 2,
                  garbage: float | None = None, seed: int = 0) -> None:
    """`attend` (a paged prefill attention) against the torch reference on `batch`, a list of
    (cached tokens, new tokens) per sequence."""
    from kernels.prefill_attention import paged_prefill_attention_torch

    seq_lens = [cached + new for cached, new in batch]
    k_cache, v_cache, table = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim,
                                               dtype, garbage=garbage, seed=seed)
    q_lens = torch.tensor([new for _, new in batch])
    cu_seqlens_q = torch.zeros(len(batch) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = q_lens.cumsum(0)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=gen)
    q = q.to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_seqlens_q = cu_seqlens_q.to(DEVICE)
    scale = head_dim ** -0.5
    out = attend(q, k_cache, v_cache, table, cu_seqlens_q, lens, scale)
    ref = paged_prefill_attention_torch(q, clean(k_cache), clean(v_cache), table, cu_seqlens_q,
                                        lens, scale)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
