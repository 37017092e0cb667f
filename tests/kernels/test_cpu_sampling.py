"""The sampler's native CPU argmax (kernels/csrc/cpu_sampling.cpp) against torch.argmax: the
same index, ties and NaN included. (The token bitmask kernel: tests/test_structured_outputs.py.)"""
import pytest
import torch

from kernels import cpu_native
from kernels.sampling import argmax_torch

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
