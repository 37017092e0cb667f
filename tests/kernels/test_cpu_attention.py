"""The native CPU decode attention (kernels/cpu_native.py) against the torch reference."""
import pytest
import torch
from kernel_cases import ATTN_TOL, clean, make_paged_cache

from kernels import cpu_native
from kernels.decode_attention import paged_decode_attention_torch

SEQ_LENS = [1, 2, 15, 16, 17, 33, 64, 65, 130, 300, 511]
NUM_KV_HEADS = 2

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernel is CPU-only and needs a C++ compiler")


def run_case(seq_lens, group, block_size, head_dim, dtype, table_width=None, strided=False):
    # NaN in every cache row no sequence owns: a read past seq_len poisons the output.
    k_cache, v_cache, table = make_paged_cache(seq_lens, block_size, NUM_KV_HEADS, head_dim,
                                               dtype, garbage=float("nan"))
    if table_width is not None:  # a padded step's table, max_model_len wide
        table = torch.nn.functional.pad(table, (0, table_width - table.shape[1]))
    gen = torch.Generator().manual_seed(1)
    heads = NUM_KV_HEADS * group
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    if strided:  # as the engine passes it: a view of the fused qkv rows
        q = torch.cat([q, torch.zeros(len(seq_lens), 2, head_dim, dtype=dtype)], 1)[:, :heads]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = cpu_native.paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, head_dim ** -0.5)
    ref = paged_decode_attention_torch(q, clean(k_cache), clean(v_cache), table, lens,
                                       head_dim ** -0.5)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [4, 8, 16, 32])  # under, at and over 8 rows (q.K takes 8 at a time)
@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_matches_reference(group, block_size, dtype):
    run_case(SEQ_LENS, group, block_size, 64, dtype)


# Each of V's summing widths (8, 4 or 2 vectors a pass, with AVX2 or AVX-512), several
# passes a row (96, 128), and a head that is not whole vectors (40: the generic loop).
@pytest.mark.parametrize("head_dim", [16, 32, 40, 96, 128])
def test_head_dims(head_dim):
    run_case(SEQ_LENS, 3, 16, head_dim, torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_whole_rows_equal_one_head_a_task(head_dim):
    """A batch with tasks enough for every thread reads a sequence's every KV head as one task
    (whole cache rows); a smaller one, one head a task. Same sums in the same order."""
    seq_lens = [3, 16, 17, 40, 130, 300, 5, 64, 1, 33]
    k_cache, v_cache, table = make_paged_cache(seq_lens, 16, NUM_KV_HEADS, head_dim,
                                               torch.float32)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * 3, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, len(seq_lens)):  # 10 sequences: >= 4 tasks a thread, then < 4
            torch.set_num_threads(n)
            outs.append(cpu_native.paged_decode_attention_cpu(q, k_cache, v_cache, table, lens,
                                                              0.1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_strided_query_and_wide_table():
    run_case([5, 200, 17], 3, 16, 64, torch.float32, table_width=64, strided=True)


def test_mode_switch(monkeypatch):
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    assert not cpu_native.available()
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=cpu_native.KERNELS_ENV):
        cpu_native.available()


def test_failed_build_falls_back_unless_native_is_required(monkeypatch):
    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_native, "load_library", no_compiler)
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "auto")
    assert not cpu_native.available()
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "native")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_native.available()


def test_a_built_library_loads_past_a_killed_builds_lock_file():
    """A build killed midway leaves torch's lock file behind, and torch's loader waits on it
    forever (every engine start hung); a built library is loaded as it is."""
    import subprocess
    import sys
    library = cpu_native.library_path()
    if not library.exists():
        pytest.skip("the kernels are not built here")
    stale = library.parent / "lock"
    stale.touch()
    try:
        subprocess.run([sys.executable, "-c", "from kernels.cpu_native import load_library; "
                        "assert load_library()"], check=True, timeout=60)
    finally:
        stale.unlink(missing_ok=True)
