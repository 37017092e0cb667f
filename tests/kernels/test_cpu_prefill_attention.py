"""The native CPU prefill / extend attention (kernels/cpu_native.py) against the torch reference."""
import pytest
import torch
from kernel_cases import check_prefill

from kernels import cpu_native

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernel is CPU-only and needs a C++ compiler")

# (cached tokens, new tokens) per sequence: fresh prompts shorter and longer than a tile of
# query rows (8 or 16 lanes), chunks after cached prefixes on and off block boundaries,
# single new tokens, and a sequence with no new rows in the step.
BATCH = [(0, 37), (45, 20), (99, 1), (0, 1), (32, 33), (16, 16), (3, 150), (200, 2), (10, 0)]


def run_case(batch, group, block_size, head_dim, garbage=float("nan")):
    # NaN in every cache row no sequence owns: a read past a row's position poisons it.
    check_prefill(cpu_native.paged_prefill_attention_cpu, batch, group, block_size, head_dim,
                  torch.float32, garbage=garbage)


@pytest.mark.parametrize("block_size", [3, 4, 16, 32])  # under and over 4 rows (q.K takes 4)
@pytest.mark.parametrize("group", [1, 3, 7])
def test_matches_reference(group, block_size):
    run_case(BATCH, group, block_size, 64)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 128])  # tails of 1-vector and scalar columns
def test_head_dims(head_dim):
    run_case([(0, 20), (30, 9), (40, 1), (0, 70)], 3, 16, head_dim)


def test_long_prompt_and_many_tiles():
    # A prompt of many tiles (the longest-first order and the shared counter across threads)
    # and a long extend after a cached prefix.
    run_case([(0, 600), (700, 90)], 3, 16, 64)


def test_sixteen_bit_keeps_the_reference():
    # float32 only natively; bf16 goes to the reference (same call, same result).
    check_prefill(cpu_native.paged_prefill_attention_cpu, [(0, 9), (5, 4)], 3, 16, 64,
                  torch.bfloat16)


def test_engine_ops_use_it():
    from kernels.backend import TORCH_OPS

    ops = cpu_native.native_ops(TORCH_OPS)
    assert ops.paged_prefill_attention is cpu_native.paged_prefill_attention_cpu
