"""The sampler's native CPU kernels (kernels/csrc/cpu_sampling.cpp) against torch: argmax (the
same index, ties and NaN included) and a logprob's log-sum-exp and rank. (The token bitmask
kernel: tests/test_structured_outputs.py.)"""
import pytest
import torch

from kernels import cpu_native
from kernels.sampling import argmax_torch, lse_and_ranks_torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 1536, 49152])  # tails, one vector, whole rows
@pytest.mark.parametrize("rows", [9, 40])  # 40 x 49152: split over threads
def test_argmax_is_torchs(vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen)
    x[1] = float("-inf")  # a row a grammar left nothing (all -inf): index 0
    x[2, vocab // 2] = float("nan")  # NaN wins, as in torch
    x[3, 0] = x[3, vocab - 1] = 100.0  # a tie: the first
    x[4] = 5.0  # all equal
    x[5, -1] = float("inf")
    x[6] = torch.round(x[6])  # many ties
    x[7, -1] = x[7, 0] = float("nan")  # the first NaN
    got = cpu_native.argmax_cpu(x)
    assert got.dtype == torch.int64 and torch.equal(got, argmax_torch(x))


def test_argmax_of_a_view_and_other_dtypes():
    x = torch.randn(6, 100)
    assert torch.equal(cpu_native.argmax_cpu(x[::2, 3:]), argmax_torch(x[::2, 3:]))  # copied
    half = x.to(torch.bfloat16)
    assert torch.equal(cpu_native.argmax_cpu(half), argmax_torch(half))  # the reference's


@pytest.mark.parametrize("vocab", [1, 7, 17, 1536, 49152])
@pytest.mark.parametrize("rows", [5, 40])
def test_lse_and_ranks_are_torchs(vocab, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=gen) * 8
    x[1] = torch.round(x[1])  # ties with the token: they do not rank above it
    x[2, -1] = 80.0  # exp(x - max) must not overflow
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[3] = x[3].argmax()  # rank 1
    tokens[4] = x[4].argmin()  # rank vocab, or tied with it
    lse, ranks = cpu_native.lse_and_ranks_cpu(x, tokens)
    want_lse, want_ranks = lse_and_ranks_torch(x, tokens)
    assert ranks.dtype == torch.int64 and torch.equal(ranks, want_ranks)
    assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_native.lse_and_ranks_cpu(x, torch.full((rows,), vocab))
