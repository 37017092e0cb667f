"""Paged prefill / extend attention against the torch reference."""
from dataclasses import replace

import pytest
import torch
from kernel_cases import ATTN_TOL, DEVICE, DTYPES, check_prefill, make_paged_cache

from kernels.prefill_attention import paged_prefill_attention_torch
from kernels.triton_attention_tuning import (
    AUTOTUNE_ENV,
    PREFILL_TILES,
    Tile,
    autotune_enabled,
    prefill_sweep_space,
    prefill_tile,
)
from kernels.triton_prefill_attention import paged_prefill_attention_triton

NUM_KV_HEADS = 2
# (cached tokens, new tokens) per sequence: new prefills, chunked prefills / prefix-cache hits
# on and off block boundaries, decodes and single-token prefills inside the same batch, and
# chunks longer than one query tile.
MIXED_BATCH = [(0, 37), (45, 20), (99, 1), (0, 1), (32, 33), (16, 16), (3, 150), (200, 2)]


def run_case(batch, group, block_size, head_dim, dtype, garbage=None, seed=0):
    check_prefill(paged_prefill_attention_triton, batch, group, block_size, head_dim, dtype,
                  NUM_KV_HEADS, garbage, seed)


# The interpreter is ~1000x slower than a GPU: on CPU, three corners of the grid.
GROUP_BLOCK = ([(g, b) for g in (1, 4, 8) for b in (16, 32)] if DEVICE.type == "cuda"
               else [(1, 16), (4, 32), (8, 16)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,block_size", GROUP_BLOCK)
def test_mixed_batch(group, block_size, dtype):
    run_case(MIXED_BATCH, group, block_size, 64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 80, 96, 128, 256])
def test_head_dims(head_dim, dtype):
    run_case([(0, 20), (30, 9), (40, 1)], 4, 16, head_dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_extends_and_prefix_hits(dtype):
    # Chunks after cached prefixes several key tiles long (the mask-free phase runs whole
    # tiles, then the diagonal band), a prefix-cache hit on a block boundary, and a fresh
    # prompt over two query tiles; NaN in every unowned cache row catches a read past seq_len.
    run_case([(130, 70), (64, 64), (0, 129)], 2, 16, 64, dtype, garbage=float("nan"))


def test_interpreter_never_autotunes(monkeypatch):
    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    assert autotune_enabled(DEVICE) == (DEVICE.type == "cuda")  # conftest: interpreter off CUDA
    run_case([(5, 9)], 2, 16, 32, torch.float16)  # CPU: the tile table; CUDA: autotuned


def test_odd_group_and_block_size():
    # 7 query heads per KV head (Qwen2.5-7B): tiles of 18 tokens x 7 heads, block size 24.
    run_case([(0, 40), (25, 19), (50, 1)], 7, 24, 64, torch.float32)


def test_never_reads_past_seq_len():
    # Unowned cache rows and padding block 0 are NaN: any read past seq_len poisons the output.
    run_case([(0, 17), (15, 2), (16, 16), (40, 1)], 4, 16, 64, torch.float32,
             garbage=float("nan"))


def test_many_sequences():
    # More sequences than one chunk (64) of the kernel's tile -> sequence search.
    batch = [(i % 20, 1 + i % 3) for i in range(70)]
    run_case(batch, 4, 16, 32, torch.float32)


def test_tiles_first_past_the_grid_limit(monkeypatch):
    """More tiles than CUDA's grid allows on its second axis flip the grid to tiles first: the
    same programs, so the same bits (the limit lowered to reach that path with a small batch)."""
    import kernels.triton_prefill_attention as prefill

    def output(max_grid_y: int) -> torch.Tensor:
        monkeypatch.setattr(prefill, "MAX_GRID_Y", max_grid_y)
        outs = []
        check_prefill(lambda *a: outs.append(paged_prefill_attention_triton(*a)) or outs[-1],
                      [(0, 37), (45, 20), (3, 1)], 4, 16, 32, torch.float32, NUM_KV_HEADS)
        return outs[0]

    assert torch.equal(output(prefill.MAX_GRID_Y), output(1))


def test_strided_query_and_empty_sequence():
    # q sliced from a fused qkv projection; a sequence with no new tokens in the batch.
    batch = [(0, 5), (10, 0), (7, 3)]
    seq_lens = [c + n for c, n in batch]
    k_cache, v_cache, table = make_paged_cache(seq_lens, 16, 2, 64, torch.float32)
    qkv = torch.randn(8, (4 + 2 + 2) * 64, device=DEVICE)
    q = qkv[:, :4 * 64].view(8, 4, 64)
    cu = torch.tensor([0, 5, 5, 8], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention_triton(q, k_cache, v_cache, table, cu, lens, 0.125)
    ref = paged_prefill_attention_torch(q, k_cache, v_cache, table, cu, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)


def test_every_tile_of_the_sweep_is_correct():
    """benchmarks/attention.py --sweep-tiles times these on a GPU to retune the table (BLOCK_M
    included): each must compute the same attention (16-bit: the sweep's own dtype class)."""
    tiles = prefill_sweep_space(32, torch.float16)
    assert prefill_tile(32, torch.float16) in tiles and {t.block_m for t in tiles} == {64, 128}
    assert {t.lazy_rescale for t in tiles} == {False, True}
    if DEVICE.type != "cuda":  # the interpreter ignores warps and stages: one lazy tile will do
        tiles = [t for t in tiles if not t.lazy_rescale] + [next(t for t in tiles if t.lazy_rescale)]
    for tile in tiles:
        check_prefill(lambda *a, tile=tile: paged_prefill_attention_triton(*a, tile=tile),
                      [(0, 37), (45, 20), (3, 1)], 4, 16, 32, torch.float16, NUM_KV_HEADS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_lazy_rescale_when_the_max_jumps(dtype):
    """The lazy rescale's both branches: the first tile (from -inf), later tiles whose max stays
    within 2**8 (stale max), and a block of large keys late in a prompt and in a cached prefix
    (a jump far past 2**8 mid-loop, for the causal and the mask-free phase)."""
    batch = [(0, 100), (70, 30)]
    seq_lens = [c + n for c, n in batch]
    k_cache, v_cache, table = make_paged_cache(seq_lens, 16, NUM_KV_HEADS, 32, dtype, seed=3)
    for seq, position in ((0, 64), (1, 48)):
        k_cache[table[seq, position // 16].long()] *= 40  # scores ~40x: far past 2**8
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(130, NUM_KV_HEADS * 4, 32, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0, 100, 130], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_prefill_attention_torch(q, k_cache, v_cache, table, cu, lens, 32 ** -0.5)
    for tile in (prefill_tile(32, dtype), Tile(64, 32, 4, 2)):
        out = paged_prefill_attention_triton(q, k_cache, v_cache, table, cu, lens, 32 ** -0.5,
                                             tile=replace(tile, lazy_rescale=True))
        torch.testing.assert_close(out, ref, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


def test_the_sweep_space_holds_every_table_tile():
    for head_dim, tile in PREFILL_TILES.items():
        for dtype in (torch.float16, torch.bfloat16):
            assert tile in prefill_sweep_space(head_dim, dtype), (head_dim, dtype)
    assert prefill_sweep_space(128, torch.float32) == [prefill_tile(128, torch.float32)]
