r"""Offline throughput: FlagServe vs HF transformers `generate` on the same random workload.

The workload follows nano-vllm's bench: N requests with random prompt lengths and random
max_tokens each, ignore_eos, on a random-weight model of a chosen size. HF runs as a user
would batch it: left-padded batches, max_new_tokens = the batch's largest request, and only the
tokens each request asked for count as output. Prints output tokens/s of each, the ratio,
the share of engine step time spent outside the model forward, and the roofline ratio: the
run's floor (the larger of its bandwidth and compute floors, throughput_roofline.py) over its
measured time.

    .venv/bin/python benchmarks/throughput.py           # CPU defaults, about a minute
    .venv/bin/python benchmarks/throughput.py --shape qwen3-0.6b --num-seqs 256 --input-len 100 1024 \
        --output-len 100 1024 --dtype bfloat16           # nano-vllm's workload, random weights
    .venv/bin/python benchmarks/throughput.py --shape llama3-8b --latency --input-len 128 128 \
        --output-len 256 256 --dtype bfloat16            # batch-1 ms per token
"""
import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import get_args

import torch

from flagserve.bench import triton_compiles
from flagserve.bench.throughput_latency import (
    decode_latency,
    profile_batch_decode,
    profile_batch_prefill,
    profile_decode,
)
from flagserve.bench.throughput_phases import PhaseTimer, StepMix, phase_table
from flagserve.bench.throughput_roofline import (
    compute_floor_seconds,
    floor_seconds,
    kv_bytes,
    kv_bytes_per_token,
    matmul_flops,
    measure_bandwidth_gbs,
    measure_peak_tflops,
    weight_bytes,
)
from flagserve.bench.throughput_shapes import Shape, write_shape
from flagserve.models.config import DTYPE_BYTES, load_model_config, transformers_location


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def prompt_vocab(model: str) -> int:
    """The token ids a workload's prompts are drawn from: the engine's prompt_vocab_size (a
    shape preset's 1,536-token test tokenizer, not its 151,936-row embedding)."""
    from flagserve.models.tokenizer import load_tokenizer, prompt_vocab_size
    return prompt_vocab_size(load_model_config(model).vocab_size, load_tokenizer(model))


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


def run_flagserve(model: str, work: Workload, args: argparse.Namespace, **engine_args) -> tuple[float, dict]:
    engine_args = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "attention_backend": args.backend, **engine_args}
    threads = torch.get_num_threads()  # the engine's thread tuner changes the process's count
    try:
        return _timed_generate(model, work, args, engine_args)
    finally:
        torch.set_num_threads(threads)  # a baseline after it (HF) gets the threads it had


def _timed_generate(model: str, work: Workload, args: argparse.Namespace,
                    engine_args: dict) -> tuple[float, dict]:
    from flagserve import LLM, SamplingParams

    llm, start_up = timed_start(lambda: LLM(model, **engine_args))
    # Warm-up on the prompts reversed (the timed run must find none of them in the prefix
    # cache). On a GPU a whole batch of them. The first run on a fresh machine can still meet
    # Triton kernel variants the warm-up did not (its prefill steps were 4x slower on an H100):
    # the timed run records those it compiles (triton_compiles.py), and the report names them.
    count = args.max_num_seqs if torch.cuda.is_available() else 4
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([p[::-1] for p in work.prompts[:count]], warm, use_tqdm=False)
    detokenize = not getattr(args, "disable_detokenize", False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=detokenize)
              for m in work.max_tokens]
    before = llm.llm_engine.get_stats()
    phases = getattr(args, "phases", False)
    timer = PhaseTimer(llm.llm_engine) if phases else None
    mix = StepMix(llm.llm_engine) if phases else None
    start = time.perf_counter()
    with timer or contextlib.nullcontext(), mix or contextlib.nullcontext(), \
            triton_compiles.recorded() as compiled:
        outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    step = stats.step_seconds - before.step_seconds
    forward = stats.forward_seconds - before.forward_seconds
    result = {**start_up, "steps": stats.num_steps - before.num_steps, "step_seconds": step,
              "forward_seconds": forward, "outside_forward_share": 1 - forward / step,
              "preemptions": stats.num_preemptions,
              "prefix_cache_hit_tokens": stats.prefix_cache_hits - before.prefix_cache_hits,
              "timed_compiles": compiled}
    if timer is not None:
        result["phases_us_per_token"] = dict(phase_table(timer.totals, step, forward, work.output_tokens))
        result["step_mix"] = mix.table()
    if getattr(args, "profile", 0):
        result["profile"] = profile_batch_decode(llm, work.prompts[:args.max_num_seqs], args.profile)
    if getattr(args, "profile_prefill", 0):
        result["profile_prefill"] = profile_batch_prefill(llm, work.prompts[:args.max_num_seqs],
                                                          args.profile_prefill)
    return elapsed, result


def timed_start(make_llm) -> tuple[object, dict]:
    """The engine, and its start-up: seconds to ready, and what its CUDA graphs cost."""
    start = time.perf_counter()
    llm = make_llm()
    out = {"start_up_seconds": time.perf_counter() - start, "graph_capture": None}
    runner = getattr(llm.llm_engine.executor, "runner", None)  # in-process executors only
    if getattr(runner, "graph_capture", None) is not None:
        out["graph_capture"] = asdict(runner.graph_capture)
    return llm, out


def format_start_up(result: dict) -> str:
    line = f"start-up           {result['start_up_seconds']:8.1f} s"
    capture = result.get("graph_capture")
    if capture:
        line += (f"  ({capture['sizes']} decode CUDA graphs in {capture['seconds']:.1f} s, "
                 f"{capture['reserved_bytes'] / 2**30:.2f} GiB reserved of "
                 f"{capture['budget_bytes'] / 2**30:.2f} GiB budgeted)")
    return line


def run_hf(model: str, work: Workload, args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    directory, gguf = transformers_location(model)  # a GGUF: transformers dequantizes it too
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **gguf).to(device).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, like the engine run
    pad = hf.config.pad_token_id or 0

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as HF wants for generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)

    generate(work.prompts[:4], 4)  # warm-up
    batch = args.hf_batch_size or len(work.prompts)
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        generate(work.prompts[i:i + batch], max(work.max_tokens[i:i + batch]))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(model: str, work: Workload, dtype: str = "float32", max_num_seqs: int = 256,
            max_num_batched_tokens: int | None = None, backend: str = "auto", hf_batch_size: int = 0,
            skip_hf: bool = False, **engine_args) -> dict:
    """FlagServe vs HF generate on `work` (the continuous_batching baseline of suite.py).

    `engine_args` are further EngineArgs of the FlagServe run (e.g. a deployment's)."""
    args = argparse.Namespace(dtype=dtype, max_num_seqs=max_num_seqs, backend=backend,
                              max_num_batched_tokens=max_num_batched_tokens, hf_batch_size=hf_batch_size)
    fs_time, fs_stats = run_flagserve(model, work, args, **engine_args)
    result = {"requests": len(work.prompts), "output_tokens": work.output_tokens,
              "flagserve_seconds": fs_time, "flagserve_output_tps": work.output_tokens / fs_time, **fs_stats}
    if not skip_hf:
        hf_time = run_hf(model, work, args)
        result.update(hf_seconds=hf_time, hf_output_tps=work.output_tokens / hf_time,
                      ratio=hf_time / fs_time, hf_batch_size=hf_batch_size or len(work.prompts))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model",
                       help="a local HF model directory or .gguf file "
                            "(default: a random model of the size below)")
    model.add_argument("--shape", choices=get_args(Shape),
                       help="a real model's shape with random weights drawn on the device "
                            "(no checkpoint; implies --skip-hf)")
    parser.add_argument("--num-layers", type=int,
                        help="with --shape: this many layers instead of the shape's own")
    parser.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"],
                        help="the random model (without --model / --shape): its architecture")
    parser.add_argument("--hidden-size", type=int, default=256, help="the random model's sizes:")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--num-seqs", type=int, default=256, help="requests of the workload")
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                        help="each prompt's length, uniform in [MIN, MAX]")
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                        help="each request's max_tokens (ignore_eos), uniform in [MIN, MAX]")
    parser.add_argument("--latency", action="store_true",
                        help="batch-1 decode instead: one prompt of --input-len MIN tokens, "
                             "--output-len MAX tokens, ms per token")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also print a torch profile of STEPS decode steps (throughput runs: "
                             "of the whole batch decoding together, after the timed run)")
    parser.add_argument("--profile-prefill", type=int, default=0, metavar="STEPS",
                        help="also print a torch profile of the first STEPS steps of the whole "
                             "batch added at once (chunked prefill steps; throughput runs)")
    parser.add_argument("--phases", action="store_true",
                        help="also time each phase of the engine step (host work per output token)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the model's; with --shape, the longest request")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="prepare each step while the device runs the one before "
                             "(default: the engine's, on for CUDA)")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="token ids only, no text (vLLM's bench flag; as nano-vllm's "
                             "benchmark, which never decodes)")
    parser.add_argument("--bandwidth-gbs", type=float,
                        help="memory bandwidth of the roofline (default: measured by a device copy)")
    parser.add_argument("--peak-tflops", type=float,
                        help="matmul rate of the roofline in --dtype (default: measured by a "
                             "square matmul on the device)")
    parser.add_argument("--hf-batch-size", type=int, default=0,
                        help="HF batch size (0: all requests at once)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_layers is not None and (args.shape is None or args.num_layers < 1):
        parser.error("--num-layers takes a positive count and needs --shape")
    if args.phases and args.latency:
        parser.error("--phases times the throughput run; leave out --latency")
    if args.profile < 0 or args.profile_prefill < 0:
        parser.error("--profile and --profile-prefill take a positive number of steps")
    if args.profile_prefill and args.latency:
        parser.error("--profile-prefill profiles the throughput run's batch; leave out --latency")
    random_model = args.model is None and args.shape is None
    if random_model and (min(args.heads, args.kv_heads) < 1 or args.hidden_size % args.heads
                         or args.heads % args.kv_heads):
        parser.error("the random model needs --hidden-size a multiple of --heads, and --heads "
                     "of --kv-heads")
    if args.hf_batch_size < 0 or args.num_seqs < 1:
        parser.error("--hf-batch-size takes 0 (all at once) or a positive size, --num-seqs a "
                     "positive count")
    for name in ("input_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            parser.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {low} {high}")
    if args.shape:
        args.skip_hf = True  # random weights: HF has nothing to load
        args.max_model_len = args.max_model_len or args.input_len[1] + args.output_len[1]
    return args


def prepare_model(args: argparse.Namespace, tmp: str) -> tuple[str, dict]:
    """(model path, the engine args it needs) for --model, --shape or the random tiny model."""
    extra = {"enforce_eager": args.enforce_eager, "max_model_len": args.max_model_len,
             "async_scheduling": args.async_scheduling}
    if args.shape:
        return write_shape(args.shape, tmp, args.num_layers), {**extra, "load_format": "dummy"}
    if args.model:
        return args.model, extra
    from flagserve.models.tiny import make_tiny_model
    head_dim = args.hidden_size // args.heads
    model = make_tiny_model(tmp, arch=args.arch, seed=args.seed, hidden_size=args.hidden_size,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=head_dim,
                            intermediate_size=args.intermediate_size, max_position_embeddings=4096)
    return str(model), extra


def roofline(args: argparse.Namespace, cfg, work: Workload, steps: int, seconds: float) -> dict:
    """The run's floor (throughput_roofline.py: the larger of its bandwidth and compute
    floors) and the share of it achieved."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elem = DTYPE_BYTES[args.dtype]
    bandwidth = args.bandwidth_gbs or measure_bandwidth_gbs(device)
    peak = args.peak_tflops or measure_peak_tflops(device, getattr(torch, args.dtype))
    prompt_lens = [len(p) for p in work.prompts]
    # No more bytes than the checkpoint holds (a bf16 one run in float32 has bf16 values, a
    # GGUF file quantized blocks, which the CPU kernels store as such: layers/cpu_matmul.py).
    if cfg.checkpoint_format == "gguf":
        from flagserve.models.gguf import gguf_weight_bytes  # the gguf package: not on GPU images
        weights = min(weight_bytes(cfg, elem), gguf_weight_bytes(args.model))
    else:
        weights = weight_bytes(cfg, min(elem, DTYPE_BYTES.get(cfg.torch_dtype, elem)))
    kv = kv_bytes(prompt_lens, work.max_tokens, kv_bytes_per_token(cfg, elem))
    flops = matmul_flops(cfg, prompt_lens, work.max_tokens)
    memory = floor_seconds(steps, weights, kv, bandwidth)
    compute = compute_floor_seconds(flops, peak)
    floor = max(memory, compute)
    return {"bandwidth_gbs": bandwidth, "weight_bytes": weights, "kv_bytes": kv,
            "bandwidth_floor_seconds": memory, "peak_tflops": peak, "flops": flops,
            "compute_floor_seconds": compute, "floor_seconds": floor,
            "roofline_ratio": floor / seconds}


def run_latency(model: str, args: argparse.Namespace, cfg, extra: dict) -> dict:
    from flagserve import LLM

    llm, start_up = timed_start(lambda: LLM(model, dtype=args.dtype, attention_backend=args.backend,
                                            max_num_seqs=1, **extra))
    rng = random.Random(args.seed)
    vocab = llm.llm_engine.prompt_vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(args.input_len[0])]
    decode_latency(llm, prompt, 4)  # warm-up
    per_step, steps = decode_latency(llm, prompt, args.output_len[1])
    work = Workload([prompt], [steps + 1])
    profiled = {"profile": profile_decode(llm, prompt, args.profile)} if args.profile else {}
    return {**start_up, "ms_per_token": per_step * 1e3, "decode_steps": steps,
            **roofline(args, cfg, work, steps, per_step * steps), **profiled}


def run_throughput(model: str, args: argparse.Namespace, cfg, extra: dict) -> dict:
    work = make_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len),
                         prompt_vocab(model), args.seed)
    fs_time, fs_stats = run_flagserve(model, work, args, **extra)
    result = {"output_tokens": work.output_tokens, "flagserve_seconds": fs_time,
              "flagserve_output_tps": work.output_tokens / fs_time, **fs_stats,
              **roofline(args, cfg, work, fs_stats["steps"], fs_time)}
    if not args.skip_hf:
        hf_time = run_hf(model, work, args)
        result.update(hf_seconds=hf_time, hf_output_tps=work.output_tokens / hf_time,
                      ratio=hf_time / fs_time)
    return result


def report(args: argparse.Namespace, result: dict) -> None:
    a = args
    if a.latency:
        print(f"batch-1 decode: prompt {a.input_len[0]} tokens, {result['decode_steps']} decode "
              f"steps, {a.dtype}, {result['device']}")
        print(f"FlagServe          {result['ms_per_token']:8.3f} ms per token")
    else:
        print(f"workload: {a.num_seqs} requests, prompts {a.input_len[0]}-{a.input_len[1]} tokens, "
              f"outputs {a.output_len[0]}-{a.output_len[1]} tokens ({result['output_tokens']} in "
              f"all), {a.dtype}, {result['device']}")
        print(f"FlagServe          {result['flagserve_seconds']:8.2f} s  "
              f"{result['flagserve_output_tps']:9.1f} output tok/s  ({result['steps']} steps, "
              f"{result['outside_forward_share']:.1%} of step time outside the model forward)")
        if "phases_us_per_token" in result:
            print("step phases, us per output token:")
            for label, us in result["phases_us_per_token"].items():
                print(f"  {label:24s} {us:8.2f}")
            print("steps by kind: steps, seconds, share of step time, ms per step, mean rows")
            for kind, steps, seconds, share, rows in result["step_mix"]:
                print(f"  {kind:28s} {steps:6d} {seconds:8.2f} s {share:6.1%} "
                      f"{seconds / steps * 1e3:8.2f} ms {rows:7.1f}")
        if result.get("timed_compiles"):  # None: this Triton cannot tell; []: none
            print(f"Triton kernel variants first met in the timed run (compiled or read from "
                  f"disk inside it): {len(result['timed_compiles'])}")
            for variant in result["timed_compiles"]:
                print(f"  {variant[:400]}")
        if "hf_seconds" in result:
            print(f"HF generate        {result['hf_seconds']:8.2f} s  "
                  f"{result['hf_output_tps']:9.1f} output tok/s")
            print(f"ratio              {result['ratio']:8.2f} x")
    if "profile" in result:
        rows = "batch-1" if a.latency else f"{min(a.num_seqs, a.max_num_seqs)}-sequence"
        print(f"profile of {a.profile} {rows} decode steps:\n{result['profile']}")
    if "profile_prefill" in result:
        print(f"profile of the first {a.profile_prefill} prefill steps of "
              f"{min(a.num_seqs, a.max_num_seqs)} prompts:\n{result['profile_prefill']}")
    print(format_start_up(result))
    print(f"roofline           {result['roofline_ratio']:8.1%} of the floor, the larger of: "
          f"bandwidth {result['bandwidth_floor_seconds']:.3g} s ({result['weight_bytes'] / 1e9:.3g} "
          f"GB of weights per step + {result['kv_bytes'] / 1e9:.3g} GB of KV at "
          f"{result['bandwidth_gbs']:.0f} GB/s), compute {result['compute_floor_seconds']:.3g} s "
          f"({result['flops'] / 1e12:.3g} TFLOP of matmuls at {result['peak_tflops']:.3g} TFLOP/s)")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, extra = prepare_model(args, tmp)
        cfg = load_model_config(model)
        run = run_latency if args.latency else run_throughput
        result = run(model, args, cfg, extra)
    result["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                        else f"CPU x{torch.get_num_threads()} threads")
    report(args, result)
    result = {"args": vars(args), **result}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def cli() -> None:
    """The command line: a model or engine setting the engine refuses (a path that does not
    exist, heads that TP cannot split, a prompt past the context) is one line, exit 1."""
    try:
        main()
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"throughput.py: {err}")


if __name__ == "__main__":
    cli()
