"""Attention kernel benchmark: FlagServe's Triton kernels vs torch SDPA on the same data.

Decode: one query token per sequence against a paged KV cache (random, fragmented block
table), uniform context per batch, batch 1..256 x context 512..32k. Three Triton timings per
shape: the path the wrapper chooses (`auto`; `splits` says which: 1 is the single pass), the
single pass forced, and split-K forced (with the split count it would use; `-` where that is
1). Reports achieved memory bandwidth of `auto` (K/V bytes read + q and out) as a share of the
GPU's peak, and torch `scaled_dot_product_attention` on the same K/V gathered into contiguous
[batch, kv_heads, context, head_dim] tensors (SDPA's best case: no paging, no padding; the
faster of native GQA and K/V expanded to the query heads, where memory allows); `vs sdpa` is
SDPA's time over ours (> 1: we are faster). `--only decode-order`: decode over contexts of
varied lengths (uniform in [c/4, 7c/4], shuffled), launched in batch order vs longest first
(the order the engine passes). Prefill, per head_dim: causal attention of whole
prompts and chunked-prefill extends on a cached prefix, in TFLOP/s, against SDPA on the same
data. Every shape also checks the Triton output against SDPA's (max err column).

    python benchmarks/attention.py                        # decode + prefill, bf16, on a GPU
    python benchmarks/attention.py --dtype float16 --only decode --peak-gbps 3350
    python benchmarks/attention.py --cuda-graph           # time without Python launch overhead
    python benchmarks/attention.py --head-dims 128 --decode-head-dims 64 128
    python benchmarks/attention.py --cpu-smoke            # tiny shapes in the Triton interpreter

Targets (issue 13): decode faster than SDPA at every shape with batch >= 8 and no fixed
split/merge cost at batch 1; prefill and extend at >= 0.9x SDPA.
"""
import argparse
import dataclasses
import math
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
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # --sweep-splits (64: the wrapper's MAX_SPLITS)


@dataclass
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("decode", "prefill", "decode-order"),
                        help="run one benchmark only (decode-order: only run by name)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--decode-head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256],
                        help="head_dims of the prefill / extend tables")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--prefill-tokens", type=int, default=16384,
                        help="tokens per prefill batch (batch = this // prompt length)")
    parser.add_argument("--extend-chunk", type=int, default=512,
                        help="new tokens per sequence in the chunked-prefill (extend) cases")
    parser.add_argument("--extend-cached", type=int, nargs="*", default=[2048, 8192],
                        help="cached prefix lengths of the extend cases (batch 4)")
    parser.add_argument("--peak-gbps", type=float, help="peak HBM bandwidth, overrides detection")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays (triton.testing.do_bench_cudagraph)")
    parser.add_argument("--sweep-tiles", nargs="?", const="all", choices=("all", "own-rows"),
                        help="also time every tile of decode_sweep_space (on the chosen decode "
                             "path) and prefill_sweep_space, to retune DECODE_TILES and "
                             "PREFILL_TILES (triton_attention_tuning.py); own-rows: only whole "
                             "prompts over their own K/V rows")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="decode: also time split-K at every count of SPLIT_COUNTS (1 = the "
                             "single pass; at least 16 positions a split), to retune the path "
                             "choice (SPLIT_WAVES, MIN_SPLIT_TOKENS)")
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
        # do_bench_cudagraph runs fn on a stream of its own that does not wait for the default
        # stream: unsynchronised, its first call read a block table still being written
        # (an illegal address at batch 32 x 8192 on an H200).
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Matmuls until the clocks are up: an idle GPU sits at low clocks (an H200's SMs at 345
    MHz), and the first rows of a table measured on a fresh machine were 2x slower than the
    same rows a minute later (batch-1 decode: 41.7 vs 20.7 us)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


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


def decode_variants(shape: Shape, batch: int, context: int, device) -> dict:
    """num_splits per timed variant: the wrapper's choice, the single pass, and split-K with
    the count it would use (None where that count is 1, i.e. no split-K variant exists)."""
    from kernels.triton_decode_attention import choose_num_splits, split_num_splits
    split = split_num_splits(batch, shape.num_kv_heads, context, device)
    return dict(auto=choose_num_splits(batch, shape.num_kv_heads, context, device), single=1,
                split=split if split > 1 else None)


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
    variants = decode_variants(shape, batch, context, device)
    row = dict(kind="decode", batch=batch, context=context, splits=variants["auto"])
    for name, splits in variants.items():
        if splits is None:
            continue
        fn = lambda n=splits: paged_decode_attention_triton(  # noqa: E731
            q, k_cache, v_cache, tables, seq_lens, scale, num_splits=n)
        row[f"{name}_us"] = 1e3 * bench_ms(fn, args.cuda_graph)
        if name == "auto":
            out = fn()
    if args.sweep_splits:
        row["by_splits"] = {n: 1e3 * bench_ms(lambda n=n: paged_decode_attention_triton(
            q, k_cache, v_cache, tables, seq_lens, scale, num_splits=n), args.cuda_graph)
            for n in SPLIT_COUNTS if n == 1 or 16 * n <= context}
    if args.sweep_tiles == "all":
        from kernels._triton_utils import next_pow2
        from kernels.triton_attention_tuning import decode_sweep_space, decode_tile
        block_d = next_pow2(shape.head_dim)
        row["table_tile"] = decode_tile(block_d, dtype)
        row["tiles"] = sweep_tiles(args, out, decode_sweep_space(block_d, dtype), lambda tile: (
            paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale,
                                          num_splits=variants["auto"], tile=tile)))
    io_bytes = kv_bytes + 2 * q.numel() * elem + tables.numel() * 4  # K/V + q + out + table
    row["gbps"] = io_bytes / row["auto_us"] / 1e3
    row["peak"] = row["gbps"] / peak_gbps if peak_gbps else None
    if fits(kv_bytes, device):  # room for the contiguous copy SDPA needs
        k = gather_contiguous(k_cache, tables, context)
        v = gather_contiguous(v_cache, tables, context)
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
        ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).squeeze(2)
        row["err"] = (out.float() - ref.float()).abs().max().item()
        row["sdpa_us"] = 1e3 * sdpa_best_ms(q4, k, v, dict(scale=scale), args.cuda_graph)
    return row


def sweep_tiles(args, out: torch.Tensor, space: list, run) -> dict:
    """tile -> microseconds of `run(tile)` for every tile of the sweep space; NaN for a tile
    that fails to compile or launch, or whose output differs from the table tile's beyond
    rounding (reported, not timed: one bad tile must not end the sweep)."""
    times = {}
    for tile in space:
        def fn(tile=tile):
            return run(tile)
        try:
            err = (fn().float() - out.float()).abs().max().item()
            times[tile] = 1e3 * bench_ms(fn, args.cuda_graph) if err < 2e-2 else float("nan")
        except Exception as exc:  # noqa: BLE001  (a tile the compiler or the GPU refuses)
            print(f"{'':>6} tile {tile_name(tile)} failed: {type(exc).__name__}: {exc}"[:200])
            times[tile] = float("nan")
    return times


def tile_name(tile) -> str:
    rows = f"M{tile.block_m}/" if tile.block_m != 16 else ""  # decode's rows are always 16
    lazy = "/lazy" if tile.lazy_rescale else ""
    return f"{rows}N{tile.block_n}/w{tile.num_warps}/s{tile.num_stages}{lazy}"


def format_sweep(row: dict) -> str:
    table_tile = row["table_tile"]
    timed = {t: us for t, us in row["tiles"].items() if not math.isnan(us)}  # NaN: wrong output
    wrong = [tile_name(t) for t in row["tiles"] if t not in timed]
    best = min(timed, key=timed.get)
    table_us = timed.get(table_tile, row.get("auto_us", row.get("triton_us")))
    # the best tile's other rescale, where swept: the lazy rescale's own share of a win
    twin = dataclasses.replace(best, lazy_rescale=not best.lazy_rescale)
    return (f"{'':>6} tiles: best {tile_name(best)} {timed[best]:.1f} us, table "
            f"{tile_name(table_tile)} {table_us:.1f} us ({table_us / timed[best]:.2f}x)"
            + (f"; {tile_name(twin)} {timed[twin]:.1f} us" if twin in timed else "")
            + (f"; failed or wrong output: {', '.join(wrong)}" if wrong else ""))


def summarize_sweep(rows: list[dict]) -> None:
    """Per kind (decode, prefill, extend) and head_dim: the tile with the best geometric-mean
    time over the swept shapes, against the table's (which holds one tile per head_dim)."""
    def timed(row: dict, tile) -> bool:
        return not math.isnan(row["tiles"].get(tile, float("nan")))

    groups = sorted({(r["kind"], r["head_dim"]) for r in rows if "tiles" in r})
    for kind, head_dim in groups:
        mine = [r for r in rows if (r["kind"], r["head_dim"]) == (kind, head_dim) and "tiles" in r]
        tiles = [t for t in mine[0]["tiles"] if all(timed(r, t) for r in mine)]
        if not tiles:
            continue

        def mean_log(tile, mine=mine):
            return sum(math.log(r["tiles"][tile]) for r in mine) / len(mine)
        best = min(tiles, key=mean_log)
        table = mine[0]["table_tile"]
        gain = math.exp(mean_log(table) - mean_log(best)) if table in tiles else float("nan")
        print(f"{kind} D={head_dim}: best tile over {len(mine)} shapes {tile_name(best)}, "
              f"{gain:.2f}x the table's {tile_name(table)} (geometric mean)")


def table_title(what: str, shape: Shape, args) -> str:
    """A table's first line: what it times, the attention shape, the dtype, the timing mode."""
    return (f"\n{what}: Hq={shape.num_q_heads} Hkv={shape.num_kv_heads} D={shape.head_dim} "
            f"block={shape.block_size} {args.dtype}" + (" (CUDA graphs)" if args.cuda_graph else ""))


def run_decode(args, shape: Shape, dtype, device, peak_gbps: float | None) -> list[dict]:
    print(table_title("decode attention", shape, args))
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'auto us':>9} {'1-pass us':>9} "
          f"{'split us':>9} {'GB/s':>7} {'%peak':>6} {'sdpa us':>9} {'vs sdpa':>8} {'max err':>8}")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = decode_case(args, shape, batch, context, dtype, device, peak_gbps)
            if row is None:
                print(f"{batch:>6} {context:>8}  skipped: the K/V cache does not fit")
                continue
            row["head_dim"] = shape.head_dim
            rows.append(row)
            print(format_decode(row))
            if "tiles" in row:
                print(format_sweep(row))
            if "by_splits" in row:
                print(format_splits(row))
    return rows


def decode_order_case(args, shape: Shape, batch: int, context: int, dtype, device) -> tuple | None:
    """(batch order us, longest first us, GB/s longest first) over varied contexts."""
    from kernels.triton_decode_attention import paged_decode_attention_triton
    longest = context * 7 // 4
    elem = torch.empty((), dtype=dtype).element_size()
    if not fits(2 * batch * longest * shape.num_kv_heads * shape.head_dim * elem, device):
        return None
    k_cache, v_cache, tables = random_paged_cache(batch, longest, shape, dtype, device)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    lens = torch.randint(context // 4, longest + 1, (batch,), device=device, dtype=torch.int32)
    first = torch.argsort(lens, descending=True).to(torch.int32)
    plain_us, first_us = (1e3 * bench_ms(lambda o=o: paged_decode_attention_triton(
        q, k_cache, v_cache, tables, lens, shape.head_dim ** -0.5, order=o), args.cuda_graph)
        for o in (None, first))
    read = 2 * int(lens.sum()) * shape.num_kv_heads * shape.head_dim * elem
    return plain_us, first_us, read / first_us / 1e3


def run_decode_order(args, shape: Shape, dtype, device) -> None:
    print(table_title("decode attention over varied contexts (uniform in [c/4, 7c/4]), batch "
                      "order vs longest first", shape, args))
    print(f"{'batch':>6} {'context':>8} {'batch order us':>15} {'longest first us':>17} "
          f"{'GB/s':>7} {'speed-up':>9}")
    ratios = []
    for context in args.contexts:
        for batch in args.batches:
            case = decode_order_case(args, shape, batch, context, dtype, device)
            if case is None:
                continue
            plain_us, first_us, gbps = case
            ratios.append(plain_us / first_us)
            print(f"{batch:>6} {context:>8} {plain_us:>15.1f} {first_us:>17.1f} {gbps:>7.0f} "
                  f"{ratios[-1]:>8.3f}x")
    if ratios:
        print(f"decode order: longest first {math.prod(ratios) ** (1 / len(ratios)):.3f}x batch "
              f"order (geometric mean of {len(ratios)} shapes), {min(ratios):.3f}-"
              f"{max(ratios):.3f}x")


def format_splits(row: dict) -> str:
    times = row["by_splits"]
    best = min(times, key=times.get)
    return (f"{'':>6} splits: best {best} {times[best]:.1f} us, the wrapper's {row['splits']} "
            f"{row['auto_us']:.1f} us ({row['auto_us'] / times[best]:.2f}x); "
            + " ".join(f"{n}:{us:.1f}" for n, us in times.items()))


def format_decode(row: dict) -> str:
    def us(key):
        return f"{row[key]:>9.1f}" if row.get(key) is not None else f"{'-':>9}"
    peak = f"{100 * row['peak']:>5.1f}%" if row["peak"] else f"{'-':>6}"
    sdpa = row.get("sdpa_us")
    tail = (f"{sdpa / row['auto_us']:>7.2f}x {row['err']:>8.1e}" if sdpa
            else f"{'-':>8} {'-':>8}")
    return (f"{row['batch']:>6} {row['context']:>8} {row['splits']:>6} {us('auto_us')} "
            f"{us('single_us')} {us('split_us')} {row['gbps']:>7.0f} {peak} {us('sdpa_us')} {tail}")


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
    sweep = {}
    if args.sweep_tiles == "all":
        from kernels._triton_utils import next_pow2
        from kernels.triton_attention_tuning import prefill_sweep_space, prefill_tile
        block_d = next_pow2(shape.head_dim)
        sweep = dict(table_tile=prefill_tile(block_d, dtype), tiles=sweep_tiles(
            args, out, prefill_sweep_space(block_d, dtype),
            lambda tile: paged_prefill_attention_triton(*args_, tile=tile)))
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
    row = dict(kind="extend" if cached else "prefill", batch=batch, q_len=q_len, cached=cached,
               triton_us=t_ms * 1e3, tflops=flops / t_ms / 1e9, sdpa_us=s_ms * 1e3,
               sdpa_tflops=flops / s_ms / 1e9, err=err, **sweep)
    if cached == 0:  # whole prompts: also over their own K/V rows, without the block table
        k_rows, v_rows = (x.transpose(1, 2).flatten(0, 1) for x in (k, v))
        row.update(own_rows_case(args, (q, k_rows, v_rows, cu_seqlens, scale), ref, out))
    return row


def own_rows_case(args, rows_args: tuple, ref: torch.Tensor, paged_out: torch.Tensor) -> dict:
    """prefill_attention_triton (the prompts' own K/V rows) with pointer loads and, where the
    GPU has them (sm_90+), tensor descriptors: microseconds and max error vs SDPA; with
    --sweep-tiles, every tile of the sweep space on the descriptor path (else pointers)."""
    from kernels.triton_prefill_attention import prefill_attention_triton
    q = rows_args[0]
    ref = ref.transpose(1, 2).reshape_as(q).float()
    has_tma = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
    result = {}
    paths = [("rows", False)] + [("desc", True)] * (has_tma and not q.shape[-1] & (q.shape[-1] - 1))
    for name, descriptor in paths:
        def fn(descriptor=descriptor, tile=None):
            return prefill_attention_triton(*rows_args, descriptor=descriptor, tile=tile)
        result[f"{name}_err"] = (fn().float() - ref).abs().max().item()
        result[f"{name}_us"] = 1e3 * bench_ms(fn, args.cuda_graph)
    if args.sweep_tiles:  # the last path timed: descriptors where there are any
        from kernels._triton_utils import next_pow2
        from kernels.triton_attention_tuning import own_rows_tile, prefill_sweep_space
        block_d = next_pow2(q.shape[-1])
        result["own_rows_sweep"] = dict(
            table_tile=own_rows_tile(block_d, q.dtype, descriptor), triton_us=result[f"{name}_us"],
            tiles=sweep_tiles(args, paged_out, prefill_sweep_space(block_d, q.dtype, True),
                              lambda tile: fn(tile=tile)))
    return result


def run_prefill(args, shape: Shape, dtype, device) -> list[dict]:
    print(table_title("prefill attention", shape, args))
    print(f"{'batch':>6} {'new':>6} {'cached':>7} {'triton us':>10} {'TFLOP/s':>8} "
          f"{'sdpa us':>9} {'TFLOP/s':>8} {'vs sdpa':>8} {'max err':>8}")
    # Whole prompts, then chunked-prefill extends (one chunk after a cached prefix).
    cases = [(max(1, args.prefill_tokens // n), n, 0) for n in args.prefill_lens]
    cases += [(4, args.extend_chunk, cached) for cached in args.extend_cached]
    rows = []
    for batch, q_len, cached in cases:
        r = prefill_case(args, shape, batch, q_len, cached, dtype, device)
        r["head_dim"] = shape.head_dim
        rows.append(r)
        print(f"{batch:>6} {q_len:>6} {cached:>7} {r['triton_us']:>10.1f} {r['tflops']:>8.1f} "
              f"{r['sdpa_us']:>9.1f} {r['sdpa_tflops']:>8.1f} "
              f"{r['sdpa_us'] / r['triton_us']:>7.2f}x {r['err']:>8.1e}")
        if "tiles" in r:
            print(format_sweep(r))
        for name, what in (("rows", "pointers"), ("desc", "descriptors")):
            if f"{name}_us" in r:
                us = r[f"{name}_us"]
                print(f"{'':>6} own K/V rows, {what}: {us:.1f} us {r['tflops'] * r['triton_us'] / us:.1f}"
                      f" TFLOP/s {r['sdpa_us'] / us:.2f}x sdpa, err {r[f'{name}_err']:.1e}")
        if "own_rows_sweep" in r:
            own = dict(r.pop("own_rows_sweep"), kind="prefill-own-rows", head_dim=shape.head_dim)
            print(format_sweep(own))
            rows.append(own)
    return rows


def summarize_decode(rows: list[dict]) -> None:
    """Per head_dim: the issue's targets (faster than SDPA at batch >= 8; batch-1 ratio) and
    how often the wrapper's path choice was the faster of the two paths."""
    for head_dim in sorted({r["head_dim"] for r in rows}):
        mine = [r for r in rows if r["head_dim"] == head_dim and r.get("sdpa_us")]
        big = [r for r in mine if r["batch"] >= 8]
        slower = [r for r in big if r["sdpa_us"] < r["auto_us"]]
        print(f"\ndecode D={head_dim}: faster than SDPA at {len(big) - len(slower)}/{len(big)} "
              "shapes with batch >= 8"
              + (": slower at " + ", ".join(f"b{r['batch']}xc{r['context']}" for r in slower)
                 if slower else ""))
        ones = [f"c{r['context']} {r['sdpa_us'] / r['auto_us']:.2f}x" for r in mine
                if r["batch"] == 1]
        print(f"decode D={head_dim}: batch 1 vs SDPA: " + (", ".join(ones) or "-"))
        both = [r for r in mine if r.get("split_us")]
        picked = [r for r in both if r["auto_us"] <= 1.05 * min(r["single_us"], r["split_us"])]
        print(f"decode D={head_dim}: the chosen path within 5% of the faster path at "
              f"{len(picked)}/{len(both)} shapes where both exist")
        with_peak = [r for r in rows if r["head_dim"] == head_dim and r["peak"]]
        if with_peak:
            large = max(with_peak, key=lambda r: r["batch"] * r["context"])
            print(f"decode D={head_dim}: {100 * large['peak']:.1f}% of peak at b{large['batch']} x "
                  f"c{large['context']}; best {100 * max(r['peak'] for r in with_peak):.1f}%")


def summarize_prefill(rows: list[dict]) -> None:
    """Per head_dim: the worst ratio to SDPA of whole prompts and of extends (target 0.9x)."""
    for head_dim in sorted({r["head_dim"] for r in rows}):
        for kind in ("prefill", "extend"):
            mine = [r for r in rows if r["head_dim"] == head_dim and r["kind"] == kind]
            if mine:
                worst = min(mine, key=lambda r: r["sdpa_us"] / r["triton_us"])
                print(f"{kind} D={head_dim}: worst {worst['sdpa_us'] / worst['triton_us']:.2f}x "
                      f"SDPA (new {worst['q_len']}, cached {worst['cached']}); best "
                      f"{max(r['tflops'] for r in mine):.1f} TFLOP/s")
        for name, what in (("rows", "pointers"), ("desc", "descriptors")):
            mine = [r for r in rows if r["head_dim"] == head_dim and f"{name}_us" in r]
            if mine:
                worst = min(r["sdpa_us"] / r[f"{name}_us"] for r in mine)
                print(f"prefill D={head_dim} over own K/V rows, {what}: worst {worst:.2f}x SDPA")


def run_all(args, dtype, device, peak_gbps: float | None) -> list[dict]:
    """Decode tables (per --decode-head-dims), prefill tables (per --head-dims), summaries."""
    torch.manual_seed(0)
    decode_rows, prefill_rows = [], []
    if args.only == "decode-order":
        for head_dim in args.decode_head_dims:
            shape = Shape(args.num_q_heads, args.num_kv_heads, head_dim, args.block_size)
            run_decode_order(args, shape, dtype, device)
        return []
    if args.only != "prefill":
        for head_dim in args.decode_head_dims:
            shape = Shape(args.num_q_heads, args.num_kv_heads, head_dim, args.block_size)
            decode_rows += run_decode(args, shape, dtype, device, peak_gbps)
    if args.only != "decode":
        for head_dim in args.head_dims:
            shape = Shape(args.num_q_heads, args.num_kv_heads, head_dim, args.block_size)
            prefill_rows += run_prefill(args, shape, dtype, device)
    summarize_decode(decode_rows)
    print()
    summarize_prefill(prefill_rows)
    summarize_sweep(decode_rows + prefill_rows)
    return decode_rows + prefill_rows


def cpu_smoke(args: argparse.Namespace) -> int:
    """No GPU: the same benchmark code on tiny fp32 shapes through the Triton interpreter.
    Checks the plumbing and the results (max err column); the timings mean nothing. The
    contexts reach split-K (the interpreter's nominal 8 SMs, a 2 x 2 batch) and not."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    vars(args).update(dtype="float32", num_q_heads=4, num_kv_heads=2, decode_head_dims=[32],
                      head_dims=[32, 64], block_size=16, batches=[1, 2, 4], contexts=[40, 2100],
                      prefill_lens=[16, 40], prefill_tokens=80, extend_chunk=8,
                      extend_cached=[24], cuda_graph=False)
    print("cpu smoke: tiny shapes in the Triton interpreter (timings are meaningless)")
    rows = run_all(args, torch.float32, torch.device("cpu"), None)
    worst = max(r.get(key, 0.0) for r in rows for key in ("err", "rows_err", "desc_err"))
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
    warm_up_gpu()
    run_all(args, getattr(torch, args.dtype), device, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
