"""The native float32 linear (kernels/csrc/cpu_linear.cpp) against F.linear in float64: every
row block size (the kernel's register blocks and their tails), inputs long enough to be split
into row chunks, output widths that are not a multiple of its column tile (32 with AVX-512,
16 with AVX2), bias, strided inputs, and a result as close to the exact sum as F.linear's own."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native

gguf = pytest.importorskip("gguf")  # CPU tests: the GPU machine's image has no gguf package
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")


def _check(x, weight, bias=None):
    packed = cpu_native.pack_linear_weight(weight)
    tile = packed.shape[2]
    assert tile in (16, 32) and packed.shape == (-(-weight.shape[0] // tile), weight.shape[1], tile)
    got = cpu_native.packed_linear(x, packed, weight.shape[0], bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    ours = (got.double() - exact).abs().max().item()
    theirs = (F.linear(x, weight, bias).double() - exact).abs().max().item()
    assert got.shape == exact.shape and got.dtype == torch.float32
    # float32 rounding of a K-term sum: the same order of error as F.linear's
    assert ours <= max(4 * theirs, 1e-5), (ours, theirs)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 25, 64, 130])
@pytest.mark.parametrize("out_features", [1, 15, 17, 31, 32, 33, 100])
def test_matches_f_linear(rows, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 72, generator=gen)
    weight = torch.randn(out_features, 72, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    _check(x, weight)
    _check(x, weight, bias)


def test_strided_rows_and_a_large_layer():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 1200, generator=gen)
    _check(x[::3, 100:676], torch.randn(3072, 576, generator=gen) * 0.05)  # rows apart in memory
    _check(x[:5, :576].t().contiguous().t(), torch.randn(96, 576, generator=gen))  # column-major: copied


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_inputs_in_row_chunks(threads):
    """Past a chunk of x (half the L2, 256 KB to 1 MB) the threads split the rows in chunks;
    1,379 rows of 1,536 (8.5 MB) leave a partial chunk and a partial row block, and the
    threads take (chunk, tile) items from one counter, runs of them ending anywhere in a chunk.
    Each output is the same FMA chain however the rows are split: equal to the rows computed
    in slices small enough not to be chunked (40 rows, 240 KB), and within float32's bound for
    a 1,536-term sum."""
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(1379, 1536, generator=gen)
    weight, bias = torch.randn(70, 1536, generator=gen), torch.randn(70, generator=gen)
    packed = cpu_native.pack_linear_weight(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.packed_linear(x, packed, 70, bias)
        sliced = [cpu_native.packed_linear(x[i:i + 40], packed, 70, bias) for i in range(0, 1379, 40)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.cat(sliced))
    exact = F.linear(x.double(), weight.double(), bias.double())
    bound = 1536 * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t() + bias.abs().double())
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [0, 1, 7, 12, 13, 100, 300])
@pytest.mark.parametrize("intermediate", [64, 40])  # whole tiles; else the two passes
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_with_silu_is_the_two_passes_bit_for_bit(rows, intermediate, with_bias):
    """packed_linear_silu == silu_and_mul(packed_linear(...)), every bit: the fused epilogue
    runs the same FMA chains and the same SiLU formula (cpu_silu.h). 300 rows of K = 1,000 are
    split into row chunks, with a partial row block."""
    gen = torch.Generator().manual_seed(rows + intermediate)
    x = torch.randn(rows, 1000, generator=gen)
    weight = torch.randn(2 * intermediate, 1000, generator=gen) * 0.05
    bias = torch.randn(2 * intermediate, generator=gen) if with_bias else None
    packed = cpu_native.pack_linear_weight(weight)
    got = cpu_native.packed_linear_silu(x, packed, 2 * intermediate, bias)
    want = cpu_native.silu_and_mul_cpu(cpu_native.packed_linear(x, packed, 2 * intermediate, bias))
    assert got.shape == (rows, intermediate) and torch.equal(got, want)
    gate, up = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).chunk(2, -1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-4, atol=1e-4)


def test_no_rows_is_an_empty_output():
    """The last layer's tail of a chunk that samples nothing has no rows (once a SIGFPE)."""
    packed = cpu_native.pack_linear_weight(torch.randn(40, 16))
    assert cpu_native.packed_linear(torch.empty(0, 16), packed, 40, torch.randn(40)).shape == (0, 40)
    assert cpu_native.silu_and_mul_cpu(torch.empty(0, 32)).shape == (0, 16)


def test_refuses_what_it_cannot_read():
    weight = torch.randn(40, 16)
    packed = cpu_native.pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_native.packed_linear(torch.randn(2, 8), packed, 40, None)  # K differs
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.packed_linear(torch.randn(2, 16, dtype=torch.float64), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_native.packed_linear(torch.randn(2, 16), packed, 40, torch.randn(39))


def _same_bits(x, narrow, wide, out_features, bias, threads):
    """Both linears on `threads` threads, with and without bias: every bit of the narrow
    packing's outputs is the wide (float32) packing's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            assert torch.equal(cpu_native.packed_linear(x, narrow, out_features, b),
                               cpu_native.packed_linear(x, wide, out_features, b))
        if out_features % 2 == 0:
            assert torch.equal(cpu_native.packed_linear_silu(x, narrow, out_features, bias),
                               cpu_native.packed_linear_silu(x, wide, out_features, bias))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 100, 300])
@pytest.mark.parametrize("out_features", [17, 64, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_half_width_packing_gives_the_float32_bits(dtype, rows, out_features, threads):
    """A weight whose values are all bfloat16 (packed with its columns interleaved in pairs)
    or all float16 (subnormal ones too), packed so, widens to the float32 weight exactly: both
    linears give every bit of the float32 packing's, in every row block tail, partial tile and
    row chunk (300 x 1,000 rows)."""
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 1000, generator=gen)
    weight = (torch.randn(out_features, 1000, generator=gen) * 0.05).to(dtype)
    weight[:, :8] = torch.tensor([1e-7, -3e-6, 6e-8, 0.0, -0.0, 2.0**-24, 1e-5, -6e-5]).to(dtype)
    bias = torch.randn(out_features, generator=gen)
    wide, narrow = (cpu_native.pack_linear_weight(w) for w in (weight.float(), weight))
    assert narrow.dtype == dtype and narrow.shape == wide.shape
    _same_bits(x, narrow, wide, out_features, bias, threads)


def _gguf_blocks(values: np.ndarray, qtype: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """gguf's quantization of values [N, K]: (its dequantized float32 weight, q and the scales
    parsed from its raw blocks as pack_linear_weight_q4_1 / _q8_0 take them)."""
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quantize(values, kind)
    n, k = values.shape
    weight = torch.from_numpy(gguf.dequantize(raw, kind).reshape(n, k).copy())
    blocks = torch.from_numpy(raw.reshape(n, k // 32, -1).copy())  # [N, K / 32, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == "Q8_0":
        return weight, [blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = blocks[..., 4:]  # byte i: value i low, value 16 + i high
    q = torch.cat([nibbles & 15, nibbles >> 4], -1).reshape(n, k)
    return weight, [q, d, m]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 12, 13, 100, 300])
@pytest.mark.parametrize("out_features", [17, 64, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_gguf_block_packing_gives_the_float32_bits(qtype, rows, out_features, threads):
    """A weight of GGUF blocks packed as its blocks computes every value as gguf's dequantize
    does: both linears give every bit of the float32 packing's, whether a step widens the
    blocks in registers (up to 5 rows) or into a float32 tile (one row block or many, row
    chunks at 300 x 1,024), in partial tiles, with bias."""
    rng = np.random.default_rng(rows * 100 + out_features)
    values = rng.standard_normal((out_features, 1024)).astype(np.float32) * 0.05
    weight, blocks = _gguf_blocks(values, qtype)
    pack = cpu_native.pack_linear_weight_q4_1 if qtype == "Q4_1" else cpu_native.pack_linear_weight_q8_0
    narrow, wide = pack(*blocks), cpu_native.pack_linear_weight(weight)
    assert narrow.dtype == torch.uint8 and narrow.shape[:2] == (wide.shape[0], 1024 // 32)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 1024, generator=gen), torch.randn(out_features, generator=gen)
    _same_bits(x, narrow, wide, out_features, bias, threads)


def test_gguf_block_packing_refuses_what_it_cannot_read():
    weight, (q, d, m) = _gguf_blocks(np.ones((40, 64), np.float32), "Q4_1")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_native.pack_linear_weight_q4_1(q[:, :48], d, m)
    with pytest.raises(RuntimeError, match="float16"):
        cpu_native.pack_linear_weight_q4_1(q, d.float(), m)
    packed = cpu_native.pack_linear_weight_q4_1(q, d, m)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_native.packed_linear(torch.randn(2, 32), packed, 40, None)  # K differs
