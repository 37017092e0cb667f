"""Paged decode attention (single pass and split-K) against the torch reference."""
import pytest
import torch
from kernel_cases import ATTN_TOL, DEVICE, DTYPES, clean, make_paged_cache

from kernels._triton_utils import num_sms
from kernels.decode_attention import paged_decode_attention_torch
from kernels.triton_attention_tuning import DECODE_TILES, decode_sweep_space, decode_tile
from kernels.triton_decode_attention import choose_num_splits, paged_decode_attention_triton

# From a single token to several hundred, on both sides of block and tile (64) boundaries.
SEQ_LENS = [1, 2, 15, 16, 17, 33, 64, 65, 130, 300, 511]
NUM_KV_HEADS = 2


def run_case(seq_lens, group, block_size, head_dim, dtype, num_splits=None, garbage=None,
             seed=0, table_width=None, tile=None):
    k_cache, v_cache, table = make_paged_cache(seq_lens, block_size, NUM_KV_HEADS, head_dim,
                                               dtype, garbage=garbage, seed=seed)
    if table_width is not None:  # a CUDA-graph-style table, max_model_len wide
        table = torch.nn.functional.pad(table, (0, table_width - table.shape[1]))
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, scale,
                                        num_splits=num_splits, tile=tile)
    ref = paged_decode_attention_torch(q, clean(k_cache), clean(v_cache), table, lens, scale)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_block_sizes(group, block_size, dtype):
    run_case(SEQ_LENS, group, block_size, 64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5], ids=["single-pass", "split-k"])
def test_both_paths(num_splits, dtype):
    run_case(SEQ_LENS, 4, 16, 64, dtype, num_splits=num_splits)


def test_path_choice_from_host_shapes():
    sms, cpu = num_sms(DEVICE), DEVICE
    # Programs fill every SM: single pass however long the context.
    assert choose_num_splits(sms, 1, 32768, cpu) == 1
    # Idle SMs: even a short context splits, one 64-key tile a split at the least.
    assert choose_num_splits(1, 1, 256, cpu) == 4 and choose_num_splits(1, 1, 64, cpu) == 1
    # A small batch with a long context splits, fewer ways as the batch grows.
    one, few = (choose_num_splits(b, 2, 32768, cpu) for b in (1, max(2, sms // 4)))
    assert one > few > 1


def test_wide_table_small_batch_takes_split_k():
    # The block table's width, not seq_lens, decides: 2 x 2 programs over a 2048-token-wide
    # table split even though the sequences themselves are short (no device sync needed).
    assert choose_num_splits(2, NUM_KV_HEADS, 128 * 16, DEVICE) > 1
    run_case([3, 70], 4, 16, 64, torch.float32, table_width=128)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows(num_splits):
    # CUDA-graph padding rows: seq_len 1 on an all-zero table row matches the reference;
    # seq_len 0 gives zeros (never NaN) on both paths.
    k_cache, v_cache, table = make_paged_cache([40, 1], 16, NUM_KV_HEADS, 64, torch.float32)
    table[1] = 0
    q = torch.randn(3, NUM_KV_HEADS * 4, 64, device=DEVICE)
    lens = torch.tensor([40, 1, 0], dtype=torch.int32, device=DEVICE)
    table = torch.cat([table, torch.zeros_like(table[:1])])
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125,
                                        num_splits=num_splits)
    ref = paged_decode_attention_torch(q[:2], k_cache, v_cache, table[:2], lens[:2], 0.125)
    torch.testing.assert_close(out[:2], ref, atol=5e-5, rtol=5e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("num_splits", [3, 16])
def test_split_counts(num_splits):
    # 16 splits of a 130-token context leave most splits empty: the merge must skip them.
    run_case([1, 17, 130, 300], 4, 16, 64, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 80, 96, 128, 256])
def test_head_dims(head_dim, dtype):
    run_case([1, 40, 97], 4, 16, head_dim, dtype)


def test_odd_group_and_block_size():
    # 7 query heads per KV head (Qwen2.5-7B), a non power-of-2 block size.
    run_case([5, 24, 100], 7, 24, 64, torch.float32, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_never_reads_past_seq_len(num_splits):
    # Unowned cache rows and padding block 0 are NaN: any read past seq_len poisons the output.
    run_case([1, 16, 17, 70], 4, 16, 64, torch.float32, num_splits=num_splits,
             garbage=float("nan"))


def test_strided_query():
    k_cache, v_cache, table = make_paged_cache([9, 50], 16, 2, 64, torch.float32)
    qkv = torch.randn(2, (8 + 2 + 2) * 64, device=DEVICE)
    q = qkv[:, :8 * 64].view(2, 8, 64)  # a slice of a fused qkv projection
    lens = torch.tensor([9, 50], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-k"])
def test_every_tile_of_the_sweep_is_correct(num_splits):
    """benchmarks/attention.py --sweep-tiles times these on a GPU to retune the table: each
    must compute the same attention (16-bit: the sweep's own dtype class)."""
    tiles = decode_sweep_space(64, torch.float16)
    assert decode_tile(64, torch.float16) in tiles and len({t.block_n for t in tiles}) == 3
    for tile in tiles:
        run_case([1, 17, 130], 4, 16, 64, torch.float16, num_splits=num_splits, tile=tile)


def test_the_sweep_space_holds_every_table_tile_and_fits_shared_memory():
    for head_dim, tile in DECODE_TILES.items():
        for dtype in (torch.float16, torch.bfloat16):
            space = decode_sweep_space(head_dim, dtype)
            assert tile in space, (head_dim, dtype)
            assert all(2 * t.block_n * head_dim * 2 * t.num_stages <= 112 * 1024 for t in space)
    assert decode_sweep_space(128, torch.float32) == [decode_tile(128, torch.float32)]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-k"])
def test_launch_order_changes_nothing(num_splits):
    # The engine launches the longest sequences first: any permutation gives the same bits,
    # and each sequence still gets its own output row.
    seq_lens = [70, 1, 300, 17, 130, 16]
    k_cache, v_cache, table = make_paged_cache(seq_lens, 16, NUM_KV_HEADS, 64, torch.float32)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * 4, 64, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    plain = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125,
                                          num_splits=num_splits)
    # the order lives where the kernel reads it (a CPU tensor cannot be read by a CUDA kernel)
    shuffled = torch.randperm(len(seq_lens), device=DEVICE)
    for order in (torch.argsort(lens, descending=True), shuffled):
        out = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.125,
                                            order=order.to(torch.int32), num_splits=num_splits)
        assert torch.equal(out, plain)
