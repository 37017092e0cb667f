"""The native kernels' thread pool (kernels/csrc/cpu_pool.cpp): the same bits at any thread
count, helpers on the OpenMP place after the caller's, a fresh pool in a forked child, and the
point of it: a helper that gets no CPU does not hold up the op."""
import os
import textwrap

import pytest
import torch
from kernel_cases import run_python

from kernels import cpu_native

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                reason="the native kernels are CPU-only and need a C++ compiler")


def _ops(gen):
    """Each op that splits its work over the pool, on inputs big enough to be split."""
    x = torch.randn(130, 576, generator=gen)
    packed = cpu_native.pack_linear_weight(torch.randn(3072, 576, generator=gen))
    res, w = torch.randn(300, 576, generator=gen), torch.randn(576, generator=gen)
    gate_up = torch.randn(300, 2 * 1536, generator=gen)
    logits = torch.randn(100, 5000, generator=gen)
    seqs, blocks = 48, 16
    q = torch.randn(seqs, 6, 64, generator=gen)
    k_cache, v_cache = (torch.randn(seqs * 8, blocks, 2, 64, generator=gen) for _ in range(2))
    table = torch.randperm(seqs * 8, generator=gen).view(seqs, 8).to(torch.int32)
    lens = torch.randint(1, 8 * blocks + 1, (seqs,), generator=gen, dtype=torch.int32)
    cu = torch.arange(0, 9 * 40, 40, dtype=torch.int32)  # prefill: 8 sequences of 40 new tokens
    qp = torch.randn(8 * 40, 6, 64, generator=gen)
    plens = torch.full((8,), 100, dtype=torch.int32)
    return {
        "linear": lambda: cpu_native.packed_linear(x, packed, 3072, None),
        "add_rms_norm": lambda: torch.cat(cpu_native.fused_add_rms_norm_cpu(res * 2, res, w, 1e-6)),
        "silu_and_mul": lambda: cpu_native.silu_and_mul_cpu(gate_up),
        "argmax": lambda: cpu_native.argmax_cpu(logits),
        "decode_attention": lambda: cpu_native.paged_decode_attention_cpu(
            q, k_cache, v_cache, table, lens, 0.125),
        "prefill_attention": lambda: cpu_native.paged_prefill_attention_cpu(
            qp, k_cache, v_cache, table[:8], cu, plens, 0.125),
    }


def test_same_bits_at_any_thread_count():
    """Each output is computed by one thread in one order, whichever thread takes its chunk."""
    ops = _ops(torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {name: op() for name, op in ops.items()}
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for name, op in ops.items():
                for _ in range(3):  # chunks go to whichever thread is free: a new split each call
                    assert torch.equal(op(), alone[name]), (name, threads)
    finally:
        torch.set_num_threads(before)


HELPERS = """
    import os
    def helpers():
        tids = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "flagserve-cpu":
                    tids.append(int(tid))
        return tids
"""


def _run(script: str, **env: str) -> None:
    """`script` in a fresh interpreter at the repository root; 77 is its way to skip."""
    proc = run_python(textwrap.dedent(HELPERS + script), timeout=60, **env)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_helpers_take_the_next_openmp_place_and_restart_after_fork():
    """The engine binds its OpenMP threads one per core; a helper started by the caller would
    inherit the caller's single core and share it. In a forked child the parent's helpers do
    not exist: the child starts its own."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    _run(f"""
    import torch
    from kernels import cpu_native
    torch.set_num_threads(2)
    x, packed = torch.randn(64, 256), cpu_native.pack_linear_weight(torch.randn(4096, 256))
    want = cpu_native.packed_linear(x, packed, 4096, None)
    [helper] = helpers()
    assert os.sched_getaffinity(0) == {{{a}}}, os.sched_getaffinity(0)
    assert os.sched_getaffinity(helper) == {{{b}}}, os.sched_getaffinity(helper)
    pid = os.fork()
    if pid == 0:  # no torch op with OpenMP threads here: GNU OpenMP hangs in a forked child
        ok = cpu_native.packed_linear(x, packed, 4096, None).tolist() == want.tolist()
        os._exit(0 if ok and len(helpers()) == 1 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    """, OMP_NUM_THREADS="2", OMP_PLACES=f"{{{a}}},{{{b}}}", OMP_PROC_BIND="close")


def test_a_stopped_helper_does_not_hold_up_the_op():
    """The caller takes every chunk no helper has taken, and waits only for chunks taken. A
    helper is stopped here (ptrace, from a child process) between two ops: every op still
    completes, on the caller alone. A split that gave the helper a share up front (OpenMP's)
    would wait for it forever."""
    _run("""
    import ctypes, signal, sys, time
    import torch
    from kernels import cpu_native
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(0x59616d61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER_ANY
    torch.set_num_threads(2)
    x, packed = torch.randn(128, 576), cpu_native.pack_linear_weight(torch.randn(3072, 576))
    want = cpu_native.packed_linear(x, packed, 3072, None).tolist()
    [helper] = helpers()
    r, w = os.pipe()
    tracer = os.fork()
    if tracer == 0:  # PTRACE_SEIZE + PTRACE_INTERRUPT stop that thread alone, until this dies
        ok = libc.ptrace(0x4206, helper, None, None) == 0 == libc.ptrace(0x4207, helper, None, None)
        os.write(w, b"1" if ok else b"0")
        time.sleep(120)
        os._exit(0)
    try:
        if os.read(r, 1) != b"1":
            print("ptrace is not permitted here")
            sys.exit(77)
        with open(f"/proc/self/task/{helper}/stat") as f:
            while f.seek(0) == 0 and f.read().rsplit(")", 1)[1].split()[0] != "t":
                time.sleep(0.01)
        for _ in range(50):
            assert cpu_native.packed_linear(x, packed, 3072, None).tolist() == want
    finally:
        os.kill(tracer, signal.SIGKILL)
        os.waitpid(tracer, 0)
    """)
