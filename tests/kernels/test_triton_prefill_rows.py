"""Whole-prompt attention over the prompts' own K/V rows (no block table) against the paged
kernel's torch reference on the same keys stored in a paged cache."""
import pytest
import torch
from kernel_cases import ATTN_TOL, DEVICE, DTYPES

from kernels.prefill_attention import paged_prefill_attention_torch
from kernels.triton_attention_tuning import Tile
from kernels.triton_prefill_attention import prefill_attention_triton

NUM_KV_HEADS = 2
# Prompts over several query and key tiles, single tokens, one ending on a tile boundary.
PROMPTS = [37, 1, 130, 16, 64, 3]


def rows_case(q_lens, group, head_dim, dtype, seed=0):
    """q, k, v as views of one qkv projection output (row stride > heads * head_dim), and the
    same k/v stored in a paged cache (one sequence per run of blocks) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    tokens, hq = sum(q_lens), NUM_KV_HEADS * group
    qkv = torch.randn(tokens, (hq + 2 * NUM_KV_HEADS) * head_dim, generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    q, k, v = qkv.split([hq * head_dim, NUM_KV_HEADS * head_dim, NUM_KV_HEADS * head_dim], -1)
    q, k, v = (x.unflatten(-1, (-1, head_dim)) for x in (q, k, v))
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    block = 16
    blocks = [-(-n // block) for n in q_lens]
    k_cache = torch.zeros(sum(blocks) + 1, block, NUM_KV_HEADS, head_dim, dtype=dtype,
                          device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32)
    first = 1
    for b, n in enumerate(q_lens):
        table[b, :blocks[b]] = torch.arange(first, first + blocks[b])
        for cache, x in ((k_cache, k), (v_cache, v)):
            cache[first:first + blocks[b]].flatten(0, 1)[:n] = x[cu[b]:cu[b + 1]]
        first += blocks[b]
    cu, table = cu.to(DEVICE), table.to(DEVICE)
    lens = (cu[1:] - cu[:-1]).to(torch.int32)
    ref = paged_prefill_attention_torch(q, k_cache, v_cache, table, cu, lens, head_dim ** -0.5)
    return q, k, v, cu, ref


def check(q_lens, group, head_dim, dtype, **kwargs):
    q, k, v, cu, ref = rows_case(q_lens, group, head_dim, dtype)
    out = prefill_attention_triton(q, k, v, cu, head_dim ** -0.5, **kwargs)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("descriptor", [False, True], ids=["pointers", "descriptor"])
@pytest.mark.parametrize("group", [1, 4])
def test_prompts(group, descriptor, dtype):
    check(PROMPTS, group, 64, dtype, descriptor=descriptor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [80, 128])
def test_head_dims(head_dim, dtype):
    # 80: padded to 128, so only pointer loads (a descriptor's box would cover the next head)
    check([20, 9, 1], 4, head_dim, dtype)


@pytest.mark.parametrize("tile", [Tile(64, 32, 4, 2, lazy_rescale=True), Tile(32, 64, 4, 2)])
def test_tiles(tile):
    # A key tile wider than the query tile, and the lazy rescale; fp16 as on a GPU
    check(PROMPTS, 2, 64, torch.float16, tile=tile, descriptor=True)


def test_descriptor_refuses_padded_head_dim():
    q, k, v, cu, _ = rows_case([5], 1, 80, torch.float32)
    with pytest.raises(AssertionError, match="box"):
        prefill_attention_triton(q, k, v, cu, 0.1, descriptor=True)
