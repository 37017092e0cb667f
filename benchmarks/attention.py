"""Attention kernel benchmark: FlagServe's Triton kernels vs torch SDPA on the same data.

Decode: one query token per sequence against a paged KV cache (random, fragmented block
table), uniform context per batch. Reports time, achieved memory bandwidth (K/V bytes read +
q and out) as a share of the GPU's peak, and torch `scaled_dot_product_attention` on the same
K/V gathered into contiguous [batch, kv_heads, context, head_dim] tensors (SDPA's best case:
no paging, no padding; the faster of native GQA and K/V expanded to the query heads, where
memory allows). Prefill: causal attention of whole prompts (and chunked-prefill extends on a
cached prefix) in TFLOP/s, against SDPA on the same data. Every shape also checks the Triton
output against SDPA's (max err column).

    python benchmarks/attention.py                        # decode + prefill, bf16, on a GPU
    python benchmarks/attention.py --dtype float16 --only decode --peak-gbps 3350
    python benchmarks/attention.py --cuda-graph           # time without Python launch overhead
    python benchmarks/attention.py --cpu-smoke            # tiny shapes in the Triton interpreter

Targets (issue 3): decode above 70% of peak HBM bandwidth at large batch x context, and faster
than SDPA at every measured shape.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Kernel modules are imported inside functions: --cpu-smoke must set TRITON_INTERPRET first.

# Peak HBM bandwidth (GB/s) by device-name fragment, most specific first.
PEAK_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
             ("H800", 3350.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
             ("A100", 1555.0), ("L40S", 864.0), ("A10", 600.0)]
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("decode", "prefill"), help="run one benchmark only")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--prefill-tokens", type=int, default=16384,
                        help="tokens per prefill batch (batch = this // prompt length)")
    parser.add_argument("--extend-chunk", type=int, default=512,
                        help="new tokens per sequence in the chunked-prefill (extend) cases")
    parser.add_argument("--extend-cached", type=int, nargs="+", default=[2048, 8192],
                        help="cached prefix lengths of the extend cases (batch 4)")
    parser.add_argument("--peak-gbps", type=float, help="peak HBM bandwidth, overrides detection")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays (triton.testing.do_bench_cudagraph)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: run tiny shapes through the Triton interpreter and check them")
    return parser.parse_args()


def detect_peak_gbps(name: str) -> float | None:
    return next((gbps for fragment, gbps in PEAK_GBPS if fragment in name), None)


def random_paged_cache(batch: int, context: int, shape: Shape, dtype, device):
    """K/V caches holding `batch` sequences of `context` tokens in shuffled blocks."""
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq + 1  # block 0: padding target
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, blocks_per_seq)
    return k_cache, v_cache, tables.to(torch.int32)


def gather_contiguous(cache, tables, context: int):
    """[batch, kv_heads, context, head_dim] copy of each sequence's cached rows."""
    batch = tables.shape[0]
    out = torch.empty((batch, cache.shape[2], context, cache.shape[3]), dtype=cache.dtype,
                      device=cache.device)
    for b in range(batch):  # one sequence at a time keeps the temporary small
        rows = cache[tables[b].long()].flatten(0, 1)[:context]  # [context, kv_heads, D]
        out[b] = rows.transpose(0, 1)
    return out


def bench_ms(fn, cuda_graph: bool) -> float:
    import triton.testing
    if not torch.cuda.is_available():  # --cpu-smoke: one interpreted run, for the plumbing
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if cuda_graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sdpa_best_ms(q, k, v, kwargs: dict, cuda_graph: bool) -> float:
    """SDPA's best time: native GQA, or K/V expanded to the query heads (some torch versions
    only reach their fastest backend without enable_gqa) when the copy fits."""
    best = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs),
                    cuda_graph)
    group = q.shape[1] // k.shape[1]
    if group > 1 and fits(2 * k.numel() * k.element_size() * group, q.device):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        best = min(best, bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs),
                                  cuda_graph))
    return best


def fits(bytes_needed: int, device) -> bool:
    if torch.device(device).type != "cuda":
        return True
    torch.cuda.empty_cache()  # memory cached by torch counts as used in mem_get_info
    free, _ = torch.cuda.mem_get_info(device)
    return bytes_needed < 0.85 * free


def decode_case(args, shape: Shape, batch: int, context: int, dtype, device,
                peak_gbps: float | None) -> dict | None:
    """One decode shape; its tensors are freed when this returns."""
    from kernels.triton_decode_attention import paged_decode_attention_triton
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * elem
    if not fits(kv_bytes, device):
        return None
    scale = shape.head_dim ** -0.5
    k_cache, v_cache, tables = random_paged_cache(batch, context, shape, dtype, device)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale)
    t_ms = bench_ms(lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens,
                                                          scale), args.cuda_graph)
    io_bytes = kv_bytes + 2 * q.numel() * elem + tables.numel() * 4  # K/V + q + out + table
    gbps = io_bytes / t_ms / 1e6
    row = dict(batch=batch, context=context, triton_us=t_ms * 1e3, gbps=gbps,
               peak=gbps / peak_gbps if peak_gbps else None)
    if fits(kv_bytes, device):  # room for the contiguous copy SDPA needs
        k = gather_contiguous(k_cache, tables, context)
        v = gather_contiguous(v_cache, tables, context)
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
        ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).squeeze(2)
        row["err"] = (out.float() - ref.float()).abs().max().item()
        row["sdpa_us"] = 1e3 * sdpa_best_ms(q4, k, v, dict(scale=scale), args.cuda_graph)
    return row


def run_decode(args, shape: Shape, dtype, device, peak_gbps: float | None) -> list[dict]:
    print(f"\ndecode attention: Hq={shape.num_q_heads} Hkv={shape.num_kv_heads} "
          f"D={shape.head_dim} block={shape.block_size} {args.dtype}"
          + (" (CUDA graphs)" if args.cuda_graph else ""))
    print(f"{'batch':>6} {'context':>8} {'triton us':>10} {'GB/s':>8} {'%peak':>6} "
          f"{'sdpa us':>9} {'speedup':>8} {'max err':>8}")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = decode_case(args, shape, batch, context, dtype, device, peak_gbps)
            if row is None:
                print(f"{batch:>6} {context:>8}  skipped: the K/V cache does not fit")
                continue
            rows.append(row)
            print(format_decode(row))
    return rows


def format_decode(row: dict) -> str:
    peak = f"{100 * row['peak']:>5.1f}%" if row["peak"] else f"{'-':>6}"
    sdpa = row.get("sdpa_us")
    tail = (f"{sdpa:>9.1f} {sdpa / row['triton_us']:>7.2f}x {row['err']:>8.1e}" if sdpa
            else f"{'-':>9} {'-':>8} {'-':>8}")
    return (f"{row['batch']:>6} {row['context']:>8} {row['triton_us']:>10.1f} "
            f"{row['gbps']:>8.0f} {peak} {tail}")


def causal_flops(q_len: int, kv_len: int, num_heads: int, head_dim: int) -> float:
    """QK^T and PV over the causally visible pairs: 2 matmuls x 2 flops per multiply-add."""
    context = kv_len - q_len
    pairs = q_len * context + q_len * (q_len + 1) / 2
    return 4.0 * num_heads * head_dim * pairs


def prefill_case(args, shape: Shape, batch: int, q_len: int, cached: int, dtype, device) -> dict:
    """`batch` sequences of `q_len` new tokens after `cached` cached ones."""
    from kernels.triton_prefill_attention import paged_prefill_attention_triton
    scale = shape.head_dim ** -0.5
    kv_len = q_len + cached
    k_cache, v_cache, tables = random_paged_cache(batch, kv_len, shape, dtype, device)
    q = torch.randn(batch * q_len, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    cu_seqlens = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    args_ = (q, k_cache, v_cache, tables, cu_seqlens, seq_lens, scale)
    out = paged_prefill_attention_triton(*args_)
    t_ms = bench_ms(lambda: paged_prefill_attention_triton(*args_), args.cuda_graph)
    k = gather_contiguous(k_cache, tables, kv_len)
    v = gather_contiguous(v_cache, tables, kv_len)
    q4 = q.view(batch, q_len, shape.num_q_heads, shape.head_dim).transpose(1, 2)
    if cached == 0:
        sdpa_kwargs = dict(is_causal=True)
    else:  # SDPA has no "causal with an offset": an explicit mask (no flash backend then)
        positions = torch.arange(kv_len, device=device)
        sdpa_kwargs = dict(attn_mask=positions[None, :] <= positions[cached:, None])
    ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True, **sdpa_kwargs)
    err = (out.float() - ref.transpose(1, 2).reshape_as(out).float()).abs().max().item()
    s_ms = sdpa_best_ms(q4, k, v, dict(scale=scale, **sdpa_kwargs), args.cuda_graph)
    flops = batch * causal_flops(q_len, kv_len, shape.num_q_heads, shape.head_dim)
    return dict(batch=batch, q_len=q_len, cached=cached, triton_us=t_ms * 1e3,
                tflops=flops / t_ms / 1e9, sdpa_us=s_ms * 1e3, sdpa_tflops=flops / s_ms / 1e9,
                err=err)


def run_prefill(args, shape: Shape, dtype, device) -> list[dict]:
    print(f"\nprefill attention: Hq={shape.num_q_heads} Hkv={shape.num_kv_heads} "
          f"D={shape.head_dim} block={shape.block_size} {args.dtype}"
          + (" (CUDA graphs)" if args.cuda_graph else ""))
    print(f"{'batch':>6} {'new':>6} {'cached':>7} {'triton us':>10} {'TFLOP/s':>8} "
          f"{'sdpa us':>9} {'TFLOP/s':>8} {'speedup':>8} {'max err':>8}")
    # Whole prompts, then chunked-prefill extends (one chunk after a cached prefix).
    cases = [(max(1, args.prefill_tokens // n), n, 0) for n in args.prefill_lens]
    cases += [(4, args.extend_chunk, cached) for cached in args.extend_cached]
    rows = []
    for batch, q_len, cached in cases:
        r = prefill_case(args, shape, batch, q_len, cached, dtype, device)
        rows.append(r)
        print(f"{batch:>6} {q_len:>6} {cached:>7} {r['triton_us']:>10.1f} {r['tflops']:>8.1f} "
              f"{r['sdpa_us']:>9.1f} {r['sdpa_tflops']:>8.1f} "
              f"{r['sdpa_us'] / r['triton_us']:>7.2f}x {r['err']:>8.1e}")
    return rows


def summarize(decode_rows: list[dict], prefill_rows: list[dict]) -> None:
    if decode_rows:
        compared = [r for r in decode_rows if r.get("sdpa_us")]
        slower = [r for r in compared if r["sdpa_us"] < r["triton_us"]]
        print(f"\ndecode: faster than SDPA at {len(compared) - len(slower)}/{len(compared)} shapes"
              + (": slower at " + ", ".join(f"b{r['batch']}xc{r['context']}" for r in slower)
                 if slower else ""))
        with_peak = [r for r in decode_rows if r["peak"]]
        if with_peak:
            big = max(with_peak, key=lambda r: r["batch"] * r["context"])
            best = max(with_peak, key=lambda r: r["peak"])
            print(f"decode: {100 * big['peak']:.1f}% of peak at the largest batch x context "
                  f"(b{big['batch']} x c{big['context']}); best {100 * best['peak']:.1f}%")
    if prefill_rows:
        slower = [r for r in prefill_rows if r["sdpa_us"] < r["triton_us"]]
        print(f"prefill: faster than SDPA at {len(prefill_rows) - len(slower)}/{len(prefill_rows)}"
              f" shapes; best {max(r['tflops'] for r in prefill_rows):.1f} TFLOP/s")


def cpu_smoke(args: argparse.Namespace) -> int:
    """No GPU: the same benchmark code on tiny fp32 shapes through the Triton interpreter.
    Checks the plumbing and the results (max err column); the timings mean nothing."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    vars(args).update(dtype="float32", num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                      batches=[1, 3], contexts=[40, 100], prefill_lens=[16, 40],
                      prefill_tokens=80, extend_chunk=8, extend_cached=[24], cuda_graph=False)
    print("cpu smoke: tiny shapes in the Triton interpreter (timings are meaningless)")
    shape = Shape(args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size)
    torch.manual_seed(0)
    decode_rows = run_decode(args, shape, torch.float32, torch.device("cpu"), None)
    prefill_rows = run_prefill(args, shape, torch.float32, torch.device("cpu"))
    summarize(decode_rows, prefill_rows)
    worst = max(r["err"] for r in decode_rows + prefill_rows)
    print(f"cpu smoke {'OK' if worst < 1e-4 else 'FAILED'}: max err vs SDPA {worst:.1e}")
    return 0 if worst < 1e-4 else 1


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        return cpu_smoke(args)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU (none found). "
              "Use --cpu-smoke to check the script on CPU with the Triton interpreter.")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: it would benchmark the interpreter")
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or detect_peak_gbps(name)
    print(f"device: {name}; peak HBM bandwidth: "
          + (f"{peak:.0f} GB/s" + (" (--peak-gbps)" if args.peak_gbps else " (by name)")
             if peak else "unknown (pass --peak-gbps)")
          + f"; torch {torch.__version__}")
    import triton
    print(f"triton {triton.__version__}")
    dtype = getattr(torch, args.dtype)
    shape = Shape(args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size)
    torch.manual_seed(0)
    decode_rows = run_decode(args, shape, dtype, device, peak) if args.only != "prefill" else []
    prefill_rows = run_prefill(args, shape, dtype, device) if args.only != "decode" else []
    summarize(decode_rows, prefill_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
