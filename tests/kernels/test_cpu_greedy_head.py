"""The greedy LM head (kernels/csrc/cpu_greedy_head.cpp): from bfloat16 logits and a float32
recompute of the candidates, the same token as the argmax of the native float32 LM head's
logits, on every row: near ties that bfloat16 cannot tell apart, exact ties (the first wins),
approximations as far off as the bound allows, and rows with logits that are not finite (-1)."""
import pytest
import torch

from kernels import cpu_native

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")


def _float32_argmax(x, weight):
    packed = cpu_native.pack_linear_weight(weight)
    return cpu_native.argmax_cpu(cpu_native.packed_linear(x, packed, weight.shape[0], None))


def _norms(weight):
    norms = weight.double().norm(dim=1) * (1 + 1e-6)
    return norms.float(), float(norms.max())


def _bf16_logits(x, weight):
    """What oneDNN's bf16 matmul gives: bf16 inputs, an exact-enough sum, rounded to bf16."""
    return (x.bfloat16().double() @ weight.bfloat16().double().T).bfloat16()


def _greedy(x, weight, approx):
    norms, top = _norms(weight)
    return cpu_native.greedy_lm_head(x, weight, approx, norms, top)


@pytest.mark.parametrize("vocab", [1, 15, 17, 100, 1000])
@pytest.mark.parametrize("k", [8, 72, 576])
def test_matches_the_float32_argmax(vocab, k):
    gen = torch.Generator().manual_seed(vocab * 7 + k)
    weight = torch.randn(vocab, k, generator=gen) * 0.05
    x = torch.randn(19, k, generator=gen) * 3
    assert torch.equal(_greedy(x, weight, _bf16_logits(x, weight)), _float32_argmax(x, weight))


def test_near_and_exact_ties_are_settled_in_float32():
    """Rows equal in bfloat16 but not in float32: bfloat16 cannot rank them, the float32
    recompute does; duplicated rows tie exactly and the first index wins, as torch.argmax."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=gen)
    base = weight[10].clone()
    x = base[None].repeat(6, 1) + 0.01 * torch.randn(6, 64, generator=gen)
    for i, j in [(11, 1e-5), (250, 2e-5), (40, -1e-5)]:
        weight[i] = base * (1 + j)  # below bfloat16's resolution (2^-8)
    weight[200] = base  # an exact tie with row 10
    weight[5] = base  # an exact tie before it
    approx = _bf16_logits(x, weight)
    want = _float32_argmax(x, weight)
    assert set(want.tolist()) <= {5, 11, 250}  # the float32 order, not the bfloat16 one
    assert torch.equal(_greedy(x, weight, approx), want)


def test_approximations_as_far_off_as_the_bound_allows():
    """Every bf16 logit moved by 0.99 of the error bfloat16 inputs and output can make
    (2^-8 |a| + (2^-7 + 2^-16) sum_k |x_k w_k|), against the float32 winner: still its token."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(2000, 96, generator=gen) * 0.1
    x = torch.randn(8, 96, generator=gen)
    want = _float32_argmax(x, weight)
    exact = x.double() @ weight.double().T
    spread = 2**-8 * exact.abs() + (2**-7 + 2**-16) * (x.double().abs() @ weight.double().abs().T)
    sign = torch.ones_like(exact)
    sign[torch.arange(8), want] = -1
    approx = (exact + 0.99 * sign * spread).bfloat16()
    approx = torch.where(approx.double() * sign > (exact + sign * spread) * sign,
                         (exact + 0.9 * sign * spread).bfloat16(), approx)  # bf16 rounding past it
    assert (approx.double().argmax(-1) != want).any()  # the bf16 argmax alone would be wrong
    assert torch.equal(_greedy(x, weight, approx), want)


def test_rows_with_logits_not_finite_get_minus_one():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(500, 32, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    approx = _bf16_logits(x, weight)
    approx[1, 7] = float("nan")
    approx[2, 499] = float("inf")
    got = _greedy(x, weight, approx)
    want = _float32_argmax(x, weight)
    assert got[1] == got[2] == -1 and got[0] == want[0] and got[3] == want[3]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_among_threads(threads):
    gen = torch.Generator().manual_seed(threads)
    weight = torch.randn(4099, 40, generator=gen) * 0.2
    x = torch.randn(133, 40, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _greedy(x, weight, _bf16_logits(x, weight))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, _float32_argmax(x, weight))
