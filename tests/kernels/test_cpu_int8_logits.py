"""The int8 logits of the greedy LM head (kernels/csrc/cpu_int8_logits.cpp): the same bits as
the quantization written out in torch (int8 weight rows, int16 input rows, exact int32 sums,
one bfloat16 rounding), whatever the rows, vocabulary and width (odd K, partial tiles, the
widest int32 sums); within the bound the greedy head relies on; and the greedy head's token on
them is the float32 argmax, outliers and near ties included."""
import pytest
import torch

from kernels import cpu_native

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")


def _levels(k: int) -> int:
    pairs = (k + 1) // 2
    return min(16383, (2**31 - 1) // (2 * pairs * 127))


def _reference(x, weight, n):
    """(approx, x_err, eta_norms) by the kernel's formulas, in torch."""
    s = weight.abs().amax(1) / 127
    qw = torch.where(s[:, None] > 0, torch.round(weight / s[:, None]).clamp(-127, 127), 0)
    eta = ((weight.double() - s.double()[:, None] * qw.double()).norm(dim=1) * (1 + 1e-6)).float()
    t = x.abs().amax(1) / _levels(x.shape[1])
    qx = torch.where(t[:, None] > 0, torch.round(x / t[:, None]).clamp(-16383, 16383), 0)
    err = ((x.double() - t.double()[:, None] * qx.double()).norm(dim=1) * (1 + 1e-6)).float()
    sums = qx.long() @ qw.long()[:n].T
    assert sums.abs().max() < 2**31
    return ((sums.float() * s[:n]) * t[:, None]).bfloat16(), err, eta


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 30])
@pytest.mark.parametrize("vocab, k", [(1, 8), (31, 7), (100, 64), (1000, 577)])
def test_same_bits_as_the_quantization_in_torch(rows, vocab, k):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab + k)
    weight = torch.randn(vocab, k, generator=gen) * 0.05
    weight[0] = 0  # a zero row: scale 0
    x = torch.randn(rows, k, generator=gen) * 3
    x[0] = 0  # a zero input row
    if rows > 2:
        x[2, 0] = 500  # an outlier
    packed, scales, eta = cpu_native.pack_int8_rows(weight)
    n = max(1, vocab - 1)  # fewer tokens than the packing holds
    approx, err = cpu_native.int8_logits(x, packed, scales, n)
    want, want_err, want_eta = _reference(x, weight, n)
    assert torch.equal(approx.view(torch.int16), want.view(torch.int16))
    assert torch.allclose(err, want_err, rtol=1e-6, atol=0) and torch.allclose(eta, want_eta, rtol=1e-6)


def test_the_widest_sums_are_exact():
    """Every input at its largest level against weights at +-127: the int32 sums at their
    bound (K Q 127 just under 2^31), for a K whose levels the bound sets below 16,383."""
    k = 2050
    weight = torch.where(torch.rand(64, k) < 0.5, -1.0, 1.0)
    weight[3] = 1.0  # a row whose every product is largest and positive
    x = torch.ones(2, k)
    packed, scales, _ = cpu_native.pack_int8_rows(weight)
    approx, _ = cpu_native.int8_logits(x, packed, scales, 64)
    want, _, _ = _reference(x, weight, 64)
    assert _levels(k) < 16383 and torch.equal(approx.view(torch.int16), want.view(torch.int16))
    assert approx[0, 3].item() == pytest.approx(k, rel=2**-8)


def test_within_the_bound_of_the_greedy_head():
    """|approx - x . w| <= |eta_v| (|x| + |eps|) + |eps| |w_v| + 2^-8 |approx| / (1 - 2^-8),
    the bound cpu_greedy_head.cpp screens with (its float32-chain term aside)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3000, 200, generator=gen) * 0.1
    weight[:, 7] *= 30  # a column of outliers in every row
    x = torch.randn(40, 200, generator=gen) * 2
    x[:, 11] *= 50
    packed, scales, eta = cpu_native.pack_int8_rows(weight)
    approx, err = cpu_native.int8_logits(x, packed, scales, 3000)
    exact = x.double() @ weight.double().T
    xn, wn = x.double().norm(dim=1)[:, None], weight.double().norm(dim=1)[None]
    bound = (eta.double()[None] * (xn + err.double()[:, None]) + wn * err.double()[:, None]
             + 2**-8 / (1 - 2**-8) * approx.double().abs())
    gap = (approx.double() - exact).abs()
    assert (gap <= bound).all()
    assert (gap > 0.05 * bound).any()  # the bound is not vacuous: it is approached


@pytest.mark.parametrize("vocab, k", [(17, 8), (1000, 72), (4000, 576)])
def test_greedy_head_on_int8_logits_is_the_float32_argmax(vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    weight = torch.randn(vocab, k, generator=gen) * 0.05
    weight[vocab // 2] = weight[vocab // 3] * (1 + 1e-6)  # a near tie no int8 sum can rank
    x = torch.randn(25, k, generator=gen) * 3
    x[3] = weight[vocab // 3] * 40  # a row that picks the tie
    x[4, 1] = float("inf")
    packed, scales, eta = cpu_native.pack_int8_rows(weight)
    approx, err = cpu_native.int8_logits(x, packed, scales, vocab)
    norms = weight.double().norm(dim=1) * (1 + 1e-6)
    tokens = cpu_native.greedy_lm_head(x, weight, approx, norms.float(), float(norms.max()), eta, err)
    packed32 = cpu_native.pack_linear_weight(weight)
    want = cpu_native.argmax_cpu(cpu_native.packed_linear(x, packed32, vocab, None))
    assert tokens[4] == -1  # not finite: the caller computes its logits
    keep = torch.arange(25) != 4
    assert torch.equal(tokens[keep], want[keep]) and want[3] in (vocab // 3, vocab // 2)


def test_a_weight_row_not_finite_leaves_every_row_to_the_logits():
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(100, 40, generator=gen)
    weight[5, 3], weight[9, 0] = float("nan"), float("inf")
    x = torch.randn(6, 40, generator=gen)
    packed, scales, eta = cpu_native.pack_int8_rows(weight)
    approx, err = cpu_native.int8_logits(x, packed, scales, 100)
    assert approx[:, [5, 9]].isnan().all() and approx[:, :5].isfinite().all()
    norms = weight.double().norm(dim=1) * (1 + 1e-6)
    tokens = cpu_native.greedy_lm_head(x, weight, approx, norms.float(), float(norms.max()), eta, err)
    assert (tokens == -1).all()
