"""A mixed step's two attention calls write into the halves of one output (kernels/out_arg.py):
every implementation writes the same values in place as it returns without `out`."""
import pytest
import torch
from kernel_cases import DEVICE, make_paged_cache

from kernels import cpu_native, get_ops
from kernels.backend import TORCH_OPS


def implementations() -> list:
    native = DEVICE.type == "cpu" and cpu_native.available()
    return [pytest.param(TORCH_OPS, id="torch"), pytest.param("triton", id="triton"),
            pytest.param(cpu_native.native_ops(TORCH_OPS) if native else None, id="cpu-native",
                         marks=pytest.mark.skipif(not native, reason="native kernels: CPU only"))]


# (cached tokens, new tokens): three decodes first, as the engine orders a mixed step, then
# prefill chunks (fresh, after a prefix, one token long).
BATCH = [(30, 1), (5, 1), (17, 1), (0, 21), (40, 9), (12, 1)]


@pytest.mark.parametrize("ops", implementations())
def test_mixed_step_halves_written_in_place(ops):
    ops = get_ops("triton", DEVICE) if ops == "triton" else ops
    nd, group, kv_heads, head_dim = 3, 4, 2, 32
    seq_lens = [c + n for c, n in BATCH]
    k_cache, v_cache, table = make_paged_cache(seq_lens, 16, kv_heads, head_dim, torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    new = [n for _, n in BATCH[nd:]]
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(nd + sum(new), group * kv_heads, head_dim,
                    generator=torch.Generator().manual_seed(0)).to(DEVICE)
    decode_args = (q[:nd], k_cache, v_cache, table[:nd], lens[:nd], 0.2)
    prefill_args = (q[nd:], k_cache, v_cache, table[nd:], cu, lens[nd:], 0.2)
    out = torch.full_like(q, float("nan"))
    decoded = ops.paged_decode_attention(*decode_args, out[:nd])
    prefilled = ops.paged_prefill_attention(*prefill_args, out[nd:])
    assert decoded.data_ptr() == out.data_ptr() and prefilled.data_ptr() == out[nd:].data_ptr()
    assert torch.equal(out[:nd], ops.paged_decode_attention(*decode_args))
    assert torch.equal(out[nd:], ops.paged_prefill_attention(*prefill_args))
