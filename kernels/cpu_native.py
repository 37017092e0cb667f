"""FlagServe's native CPU kernels (kernels/csrc/cpu_*.cpp), built once per machine (issue 16).

- Decode attention reads the paged cache in place (cpu_paged_attention.cpp) instead of
  gathering every sequence's blocks into a dense copy for SDPA (decode_attention.py): on a
  full decode batch that copy is more bytes per step than the model's weights.
- Prefill attention (cpu_paged_prefill.cpp, float32) reads the cache in place too, a tile
  of query rows in the lanes of a vector, where SDPA per sequence ran at 0.4x its speed.
- The float32 linear layers multiply by a weight packed into tiles of 32 output columns
  (16 with AVX2; cpu_linear.cpp; flagserve/layers/cpu_matmul.py chooses it over oneDNN).
- RMSNorm, residual add + RMSNorm, SiLU-and-mul and rotary + KV store are one pass each
  (cpu_elementwise.cpp) where the reference runs 5-15 torch ops.
- The sampler's argmax and a grammar's token bitmask are one pass each over the logits, a
  logprob's log-sum-exp and rank two (cpu_sampling.cpp), where torch's take 5-10x longer.
- Their threads share each op's work from one counter (cpu_pool.cpp) rather than OpenMP's
  equal shares, so a thread that loses its core to a neighbour does not hold up the op.

Built once per machine with the C++ compiler torch.compile uses too, into
~/.cache/flagserve/cpu-kernels (keyed by the sources, torch's version and the CPU's flags:
it is compiled for this CPU): by the Makefile's install, beside pip (it needs only torch),
else by the first process that asks. Where no compiler works, `available()` is False and the engine
keeps the torch reference. FLAGSERVE_CPU_KERNELS=auto (default: native when it builds) |
native (fail if it does not build) | torch (the reference).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import time
from functools import cache
from pathlib import Path

import torch

from kernels.backend import KernelOps
from kernels.env import KERNELS_ENV, CpuKernels, cache_root, env_choice
from kernels.out_arg import written
from kernels.prefill_attention import paged_prefill_attention_torch
from kernels.rms_norm import rms_norm_torch
from kernels.sampling import apply_token_bitmask_torch, argmax_torch, lse_and_ranks_torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("cpu_*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("cpu_*.h"))  # in the build key too
CACHE = cache_root() / "cpu-kernels"


def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _capability(flags: str) -> list[str]:
    """ATen's vector width for this CPU (at::vec compiles to scalar code without one)."""
    have = set(flags.split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= have:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _build_name() -> str:
    key = hashlib.sha256(torch.__version__.encode() + cpu_flags().encode())
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    return f"flagserve_cpu_kernels_{key.hexdigest()[:12]}"


def library_path() -> Path:
    """Where this machine's build of the current sources is (or goes)."""
    name = _build_name()
    return CACHE / name / f"{name}.so"


@cache
def load_library() -> bool:
    """Builds (once per machine) and loads the ops into torch.ops.flagserve_cpu."""
    library = library_path()
    directory = library.parent
    directory.mkdir(parents=True, exist_ok=True)
    # An flock, which the kernel drops when its holder dies: torch's own lock file outlives a
    # build killed midway and makes every later build wait on it forever.
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if library.exists():
            # As it is, whichever checkout built it (the name is its sources' hash): load()
            # would rebuild it for this checkout's paths, checkouts taking turns.
            torch.ops.load_library(str(library))
        else:
            (directory / "lock").unlink(missing_ok=True)  # a killed build's: none runs now
            _build(directory.name, directory)  # and loads it
    return True


def _build(name: str, directory: Path) -> None:
    from torch.utils import cpp_extension

    log.info("building FlagServe's CPU kernels (once per machine, ~40 s on 2 cores) into %s",
             directory)
    start = time.perf_counter()
    # -fopenmp: the kernels' own pool (csrc/cpu_pool.cpp) asks OpenMP for the engine's core
    # binding; the libgomp it links resolves to the one torch already loaded (same soname).
    cpp_extension.load(name, [str(s) for s in SOURCES],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", *_capability(cpu_flags())],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory),
                       is_python_module=False, verbose=False)
    log.info("built the CPU kernels in %.1f s", time.perf_counter() - start)


def kernels_mode(requested: str | None = None) -> CpuKernels:
    return env_choice(KERNELS_ENV, CpuKernels, "auto", requested)


def available(mode: str | None = None) -> bool:
    """Whether CPU engines run the native kernels (building them if needed)."""
    mode = kernels_mode(mode)
    if mode == "torch":
        return False
    try:
        return load_library()
    except Exception as exc:  # no compiler, headers or a failed build: the reference still works
        if mode == "native":
            raise
        log.warning("native CPU kernels unavailable, using the torch reference: %s", exc)
        return False


# The ops, with the contracts of their torch references (kernels/*.py).

def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, out: torch.Tensor | None = None,
                               order: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ARG001
    return written(out, torch.ops.flagserve_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale))


def paged_prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    # float32 only: 16-bit CPU models are an option, and keep the reference.
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32) or q.stride(2) != 1:
        return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                             seq_lens, scale, out)
    return written(out, torch.ops.flagserve_cpu.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale))


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _rows(x) or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    return torch.ops.flagserve_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_rows(x) and _rows(residual)) or weight.dtype != x.dtype:
        residual = x + residual
        return rms_norm_torch(residual, weight, eps), residual
    return torch.ops.flagserve_cpu.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    out = torch.ops.flagserve_cpu.silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)  # not -1: ambiguous for 0 rows


def rotary_store_kvcache_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor,
                             q_norm_weight: torch.Tensor | None = None,
                             k_norm_weight: torch.Tensor | None = None,
                             eps: float = 0.0) -> torch.Tensor:
    if q_norm_weight is not None:  # Qwen3's per-head norms, each head a row (then fused)
        q = rms_norm_cpu(q.reshape(-1, q.shape[-1]), q_norm_weight, eps).view(q.shape)
        k = rms_norm_cpu(k.reshape(-1, k.shape[-1]), k_norm_weight, eps).view(k.shape)
    torch.ops.flagserve_cpu.rotary_store_kvcache(positions, q, k, v, k_cache, v_cache,
                                                 slot_mapping, cos_sin_cache)
    return q


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as packed_linear reads it: [ceil(N / 32), K, 32], zero-padded, in its
    dtype: float32, or bfloat16 (its columns interleaved in pairs: cpu_linear.cpp) or float16,
    which packed_linear widens to float32 as it reads it."""
    load_library()
    return torch.ops.flagserve_cpu.pack_linear_weight(weight)


def pack_linear_weight_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks of a weight [N, K] (q [N, K] uint8, d and m [N, K / 32] float16) as
    packed_linear reads them: [ceil(N / 32), K / 32, 640] uint8 (cpu_gguf_blocks.h)."""
    load_library()
    return torch.ops.flagserve_cpu.pack_linear_weight_q4_1(q, d, m)


def pack_linear_weight_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks of a weight [N, K] (q [N, K] int8, d [N, K / 32] float16) as packed_linear
    reads them: [ceil(N / 32), K / 32, 1088] uint8 (cpu_gguf_blocks.h)."""
    load_library()
    return torch.ops.flagserve_cpu.pack_linear_weight_q8_0(q, d)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) in float32 for x [M, K] float32 against
    pack_linear_weight(weight)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.flagserve_cpu.packed_linear(x, packed, out_features, bias)


def packed_linear_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """silu_and_mul(packed_linear(...)) for a gate-up weight [gate; up] of out_features rows
    (2 x intermediate): the same bits, without writing the [M, out_features] product."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.flagserve_cpu.packed_linear_silu(x, packed, out_features, bias)


def greedy_lm_head(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor, norms: torch.Tensor,
                   max_norm: float, eta_norms: torch.Tensor | None = None,
                   x_err: torch.Tensor | None = None) -> torch.Tensor:
    """[M] int64: the argmax of each row of x @ weight[:len(norms)].T in float32, found from
    approx (the same in bfloat16, or int8_logits' with its eta_norms and x_err;
    cpu_greedy_head.cpp), -1 where approx is not finite."""
    return torch.ops.flagserve_cpu.greedy_lm_head(x, weight, approx, norms, max_norm, eta_norms, x_err)


def pack_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float32 as int8_logits reads it: (packed int8, per-row scales, per-row
    |w - scale * q| rounded up; cpu_int8_logits.cpp)."""
    load_library()
    return torch.ops.flagserve_cpu.pack_int8_rows(weight)


def int8_logits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ weight[:n].T approximated from int8 weights and int16 inputs, in bfloat16; each
    row's input rounding |eps|) for x [M, K] float32 (cpu_int8_logits.cpp)."""
    return torch.ops.flagserve_cpu.int8_logits(x.contiguous(), packed, scales, n)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return apply_token_bitmask_torch(logits, bitmask)
    return torch.ops.flagserve_cpu.apply_token_bitmask(logits, bitmask)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return argmax_torch(logits)
    return torch.ops.flagserve_cpu.argmax_rows(logits)


def lse_and_ranks_cpu(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return lse_and_ranks_torch(logits, tokens)
    return torch.ops.flagserve_cpu.lse_and_ranks(logits, tokens)


def native_ops(ops: KernelOps) -> KernelOps:
    """`ops` with every op that has a native CPU kernel replaced by it."""
    return dataclasses.replace(ops, name=f"{ops.name}+cpu-native",
                               paged_decode_attention=paged_decode_attention_cpu,
                               paged_prefill_attention=paged_prefill_attention_cpu,
                               rms_norm=rms_norm_cpu, fused_add_rms_norm=fused_add_rms_norm_cpu,
                               silu_and_mul=silu_and_mul_cpu,
                               rotary_store_kvcache=rotary_store_kvcache_cpu,
                               apply_token_bitmask=apply_token_bitmask_cpu, argmax=argmax_cpu,
                               lse_and_ranks=lse_and_ranks_cpu,
                               packed_silu_and_mul=packed_linear_silu,
                               orders_decodes=False)
