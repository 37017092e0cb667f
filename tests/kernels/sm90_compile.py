"""Compile every Triton kernel for an H100 (sm_90) without a GPU, exactly as the wrappers
launch it, and report registers / spills / shared memory. Catches compile-only errors (the interpreter is
far more permissive than the compiler) on machines with no GPU.

Run directly (`python tests/kernels/sm90_compile.py`) or through test_triton_sm90_compile.py.
TRITON_INTERPRET must be unset: the kernels have to be real JIT functions.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import kernels.triton_ops  # noqa: E402,F401  (imports every kernel module)
from kernels._triton_utils import next_pow2  # noqa: E402
from kernels.triton_activation import silu_and_mul_triton  # noqa: E402
from kernels.triton_attention_tuning import (  # noqa: E402
    OWN_ROWS_TMA_TILES,
    decode_tile,
    own_rows_tile,
    prefill_tile,
)
from kernels.triton_decode_attention import paged_decode_attention_triton  # noqa: E402
from kernels.triton_prefill_attention import (  # noqa: E402
    paged_prefill_attention_triton,
    prefill_attention_triton,
)
from kernels.triton_rms_norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from kernels.triton_rotary_store import rotary_store_kvcache_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
         torch.int32: "i32", torch.int64: "i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
MAX_SHARED_BYTES = 232448  # an H100 block's limit (227 KB): more fails at launch, not compile
# (Hq, Hkv, head_dim, block_size, dtype): Llama-3-8B, Qwen2.5-7B (group 7), Llama-2-7B-like
# MHA at head_dim 64 / 80 (phi), Gemma-like head_dim 256, and fp32.
ATTENTION_SHAPES = [(32, 8, 128, 16, torch.bfloat16), (32, 8, 128, 32, torch.float16),
                    (28, 4, 128, 16, torch.bfloat16), (32, 32, 64, 16, torch.bfloat16),
                    (32, 32, 80, 16, torch.float16), (8, 4, 256, 16, torch.bfloat16),
                    (16, 2, 128, 16, torch.float32)]


def _compile(fn, args: tuple, kwargs: dict) -> str:
    """Specialise like the JIT does (16-byte alignment / divisibility), compile, report."""
    constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, attrs = {}, {}
    for name, value in zip([n for n in fn.arg_names if n not in constexprs], args):
        index = fn.arg_names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[name], divisible = "fp32", False
        elif isinstance(value, TensorDescriptor):  # the JIT's own name of its type
            signature[name], divisible = mangle_type(value), False
        else:
            signature[name] = "i32" if abs(value) < 2 ** 31 else "i64"
            divisible = value % 16 == 0
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    kernel = triton.compile(src, target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    line = next(line.strip() for line in usage.splitlines() if "REG:" in line)
    regs = " ".join(part for part in line.split() if part.split(":")[0] in ("REG", "STACK"))
    return f"{regs} SMEM:{kernel.metadata.shared}"


class _Capture:
    """Stands in for JITFunction.run: compiles the launch instead of running it."""

    def __init__(self, fn, reports: list):
        self.fn, self.reports = fn, reports

    def __call__(self, *args, grid, warmup, **kwargs):
        self.reports.append((self.fn.__name__, _compile(self.fn, args, kwargs)))


def _patch_kernels(reports: list) -> None:
    for module in [m for name, m in sys.modules.items() if name.startswith("kernels.triton_")]:
        for value in vars(module).values():
            is_kernel = isinstance(value, triton.runtime.jit.JITFunction)
            if is_kernel and value.fn.__name__.endswith("kernel"):  # launched, not a helper
                value.run = _Capture(value, reports)


def cases():
    """(label, thunk, spills allowed) triples: realistic model shapes for each op, run on CPU
    tensors. Spills are allowed only where the tile table says they were measured faster."""
    t = torch.empty

    def attention(hq, hkv, d, bs, dtype, num_splits):
        k_cache = t(64, bs, hkv, d, dtype=dtype)
        tables = torch.ones(4, 8, dtype=torch.int32)
        lens = torch.full((4,), 100, dtype=torch.int32)
        if num_splits:  # decode: 1 is the single pass, more is split-K (+ merge); the engine's
            order = torch.arange(4, dtype=torch.int32)  # launch order, as the engine passes one
            return lambda: paged_decode_attention_triton(t(4, hq, d, dtype=dtype), k_cache, k_cache,
                                                         tables, lens, 0.1, order=order,
                                                         num_splits=num_splits)
        cu = torch.tensor([0, 1, 2, 50, 99], dtype=torch.int32)
        return lambda: paged_prefill_attention_triton(t(99, hq, d, dtype=dtype), k_cache, k_cache,
                                                      tables, cu, lens, 0.1)

    def own_rows(hq, hkv, d, dtype, descriptor):
        kv = t(99, hkv, d, dtype=dtype)
        cu = torch.tensor([0, 1, 2, 50, 99], dtype=torch.int32)
        return lambda: prefill_attention_triton(t(99, hq, d, dtype=dtype), kv, kv, cu, 0.1,
                                                descriptor=descriptor)

    for num_splits in (1, 4, 0):
        kind = f"decode/{num_splits}" if num_splits else "prefill"
        for hq, hkv, d, bs, dtype in ATTENTION_SHAPES:
            label = f"{kind} Hq={hq} Hkv={hkv} D={d} bs={bs} {TYPES[dtype]}"
            tile = (decode_tile if num_splits else prefill_tile)(next_pow2(d), dtype)
            yield label, attention(hq, hkv, d, bs, dtype, num_splits), tile.spills
    for hq, hkv, d, _, dtype in ATTENTION_SHAPES:
        # descriptors where the wrapper picks them: 16-bit, head_dims of OWN_ROWS_TMA_TILES
        for descriptor in (False, True)[:1 + (d in OWN_ROWS_TMA_TILES and dtype != torch.float32)]:
            label = (f"prefill own rows ({'descriptors' if descriptor else 'pointers'}) "
                     f"Hq={hq} Hkv={hkv} D={d} {TYPES[dtype]}")
            tile = own_rows_tile(next_pow2(d), dtype, descriptor)
            yield label, own_rows(hq, hkv, d, dtype, descriptor), tile.spills
    bf16 = dict(dtype=torch.bfloat16)
    yield "rms_norm H=4096 bf16", lambda: rms_norm_triton(t(4, 4096, **bf16), t(4096, **bf16), 1e-6), False
    yield "fused_add_rms_norm H=8192 bf16", lambda: fused_add_rms_norm_triton(
        t(4, 8192, **bf16), t(4, 8192, **bf16), t(8192, **bf16), 1e-6), False
    for norm in (False, True):
        w = dict(q_norm_weight=t(128, **bf16), k_norm_weight=t(128, **bf16)) if norm else {}
        yield f"rotary_store qk_norm={norm} Hq=32 Hkv=8 D=128 bf16", lambda w=w: (
            rotary_store_kvcache_triton(
                torch.zeros(4, dtype=torch.int64), t(4, 32, 128, **bf16), t(4, 8, 128, **bf16),
                t(4, 8, 128, **bf16), t(8, 16, 8, 128, **bf16), t(8, 16, 8, 128, **bf16),
                torch.zeros(4, dtype=torch.int64), t(16, 128), eps=1e-6, **w)), False
    yield "silu_and_mul I=14336 bf16", lambda: silu_and_mul_triton(t(4, 2 * 14336, **bf16)), False


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    reports: list = []
    _patch_kernels(reports)
    spills = too_big = 0
    for label, launch, spills_allowed in cases():
        reports.clear()
        launch()
        for name, usage in reports:
            spilled = "STACK:0" not in usage.split()
            note = " (spills: measured faster)" if spilled and spills_allowed else ""
            print(f"{label:45s} {name:24s} {usage}{note}")
            spills += spilled and not spills_allowed
            smem = int(usage.split("SMEM:")[1])
            too_big += smem > MAX_SHARED_BYTES
    print(f"{spills} kernel(s) spill registers" if spills else "no unexpected register spills")
    if too_big:
        print(f"{too_big} kernel(s) need more than {MAX_SHARED_BYTES} bytes of shared memory")
    return 1 if spills or too_big else 0


if __name__ == "__main__":
    sys.exit(main())
