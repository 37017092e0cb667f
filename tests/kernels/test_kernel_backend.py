"""Backend selection, the environment switch, lazy triton import, and ops wired end to end."""
import pytest
import torch
from kernel_cases import ATTN_TOL, DEVICE, DTYPES, make_paged_cache, run_python

from kernels import get_ops, resolve_backend
from kernels.backend import BACKEND_ENV, INTERPRET_ENV, TORCH_OPS


def test_auto_and_env_switch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"  # triton is installed
    monkeypatch.setenv(BACKEND_ENV, "triton")
    # Triton on a CPU device needs the interpreter switch; conftest sets it only where there
    # is no GPU, so set it here: the selection rule is the same on any machine.
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert resolve_backend("auto", "cpu") == "triton"
    assert resolve_backend("torch", "cpu") == "torch"  # an explicit choice beats the env
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend("auto", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("cuda", "cpu")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    # triton.language's own jit helpers (tl.sum, ...) take the interpreter setting of the
    # first `import triton`: import it before the switch goes off, or later kernel tests break.
    pytest.importorskip("triton")
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    with pytest.raises(ValueError, match=INTERPRET_ENV):
        resolve_backend("triton", "cpu")


def test_torch_only_imports_stay_cheap():
    # Importing kernels (and using the reference) never imports triton, and works without it.
    code = ("import sys; import kernels; from kernels import get_ops, resolve_backend;"
            "assert get_ops('auto', 'cpu').name == 'torch';"
            "assert 'triton' not in sys.modules, 'triton imported';"
            "sys.modules['triton'] = None;"  # from here on `import triton` fails
            "assert resolve_backend('auto', 'cuda') == 'torch';"
            "import pytest\n"
            "with pytest.raises(ValueError, match='triton package'): resolve_backend('triton', 'cuda')")
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_kernels_imported_before_interpreter_switch():
    code = ("import os; from kernels.triton_rms_norm import rms_norm_triton;"
            "os.environ['TRITON_INTERPRET'] = '1'; from kernels import get_ops\n"
            "try: get_ops('triton', 'cpu')\n"
            "except ValueError as e: print(e)")
    result = run_python(code)
    assert "imported before TRITON_INTERPRET=1" in result.stdout, result.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_then_decode_through_ops(dtype):
    """One sequence in two prefill chunks and two decode steps beside a second sequence, the
    engine's call order (rotate + store, then attend), Triton ops against torch ops."""
    triton_ops = get_ops("triton", DEVICE)
    assert triton_ops.name == "triton"
    from kernels.triton_ops import TRITON_OPS
    assert triton_ops is TRITON_OPS
    block_size, kv_heads, q_heads, head_dim = 16, 2, 8, 64
    _, _, table = make_paged_cache([60, 60], block_size, kv_heads, head_dim, dtype)
    num_blocks = int(table.max()) + 1
    caches = {name: [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                                 device=DEVICE) for _ in range(2)] for name in ("torch", "triton")}
    gen = torch.Generator().manual_seed(0)
    angles = torch.arange(64)[:, None] * 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(DEVICE)

    def slots(seq, positions):
        return [int(table[seq, p // block_size]) * block_size + p % block_size for p in positions]

    # (sequence, first new position, new tokens) per step; a padding token rides along.
    steps = [[(0, 0, 23), (1, 0, 40)], [(0, 23, 17)], [(1, 40, 1), (0, 40, 1)], [(0, 41, 1)]]
    for step in steps:
        num_new = sum(n for _, _, n in step)
        slot_mapping = sum((slots(s, range(p, p + n)) for s, p, n in step), []) + [-1]
        slot_mapping = torch.tensor(slot_mapping, device=DEVICE)
        q = torch.randn(num_new + 1, q_heads, head_dim, generator=gen).to(DEVICE, dtype)
        k, v = (torch.randn(num_new + 1, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
                for _ in range(2))
        seq_lens = torch.tensor([p + n for _, p, n in step], dtype=torch.int32, device=DEVICE)
        positions = torch.tensor(sum((list(range(p, p + n)) for _, p, n in step), []) + [0],
                                 device=DEVICE)
        tables = table[[s for s, _, _ in step]]
        outs = {}
        whole = all(p == 0 for _, p, _ in step)  # the engine's prefill_attention step
        cu = torch.tensor([0] + list(torch.tensor([n for _, _, n in step]).cumsum(0)),
                          dtype=torch.int32, device=DEVICE)
        for name, ops in (("torch", TORCH_OPS), ("triton", triton_ops)):
            kr = k.clone()
            qr = ops.rotary_store_kvcache(positions, q.clone(), kr, v, *caches[name],
                                          slot_mapping, cos_sin,
                                          **(dict(rotate_k=True) if name == "triton" else {}))
            if whole and name == "triton":
                outs[name] = ops.prefill_attention(qr[:-1], kr[:-1], v[:-1], cu, 0.125)
            elif all(n == 1 for _, _, n in step):
                outs[name] = ops.paged_decode_attention(qr[:-1], *caches[name], tables, seq_lens,
                                                        0.125)
            else:
                outs[name] = ops.paged_prefill_attention(qr[:-1], *caches[name], tables, cu,
                                                         seq_lens, 0.125)
        assert torch.equal(caches["torch"][1], caches["triton"][1])  # V: a copy
        atol, rtol = ATTN_TOL[dtype]
        torch.testing.assert_close(caches["triton"][0], caches["torch"][0], atol=atol, rtol=rtol)
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=atol, rtol=rtol)
