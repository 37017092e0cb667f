"""Offline A/B of engine settings in one process, alternating (for noisy, shared machines).

Each variant is one LLM built with its engine arguments and, while it loads, its environment
variables (load-time switches such as FLAGSERVE_CPU_MATMUL). Every repetition draws fresh
prompts (a repeated prompt would measure the prefix cache), runs them through every variant
in turn, the order rotating, and reports output tokens/s and the ratio to the first variant.

    python benchmarks/cpu_ab.py --model M.gguf --variant aten:FLAGSERVE_CPU_MATMUL=aten \\
        --variant onednn:FLAGSERVE_CPU_MATMUL=onednn --reps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, fields
from typing import Any

from flagserve.bench.args import positive_int
from flagserve.bench.throughput import Workload, make_workload, prompt_vocab
from flagserve.engine.cpu_threads import TUNING_ENV
from flagserve.engine.engine_args import EngineArgs

ENGINE_ARGS = {f.name for f in fields(EngineArgs)}


@dataclass
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None  # torch threads while this variant runs (None: unchanged)


def parse_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_variant(spec: str) -> Variant:
    """`name:KEY=V,key=v`: upper-case keys are environment variables, `threads` the torch
    threads, others EngineArgs."""
    name, _, rest = spec.partition(":")
    variant = Variant(name)
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
        if not key.isupper() and key != "threads" and key not in ENGINE_ARGS:
            raise argparse.ArgumentTypeError(f"{key!r} is neither threads nor an EngineArgs field")
        if key.isupper():
            variant.env[key] = value
        elif key == "threads":
            variant.threads = int(value)
        else:
            variant.engine_args[key] = parse_value(value)
    if variant.threads:  # else the engine's thread tuner would choose per step (cpu_threads.py)
        variant.env.setdefault(TUNING_ENV, "off")
    return variant


def build(model: str, variant: Variant, common: dict[str, Any]):
    from flagserve import LLM

    saved = {k: os.environ.get(k) for k in variant.env}
    os.environ.update(variant.env)
    try:
        return LLM(model, **{**common, **variant.engine_args})
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_once(engine: tuple[Any, Variant], work: Workload) -> float:
    import torch

    from flagserve import SamplingParams

    llm, variant = engine
    if variant.threads:
        torch.set_num_threads(variant.threads)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    start = time.perf_counter()
    llm.generate(work.prompts, params, use_tqdm=False)
    return work.output_tokens / (time.perf_counter() - start)


def alternate(engines: dict[str, Any], args: argparse.Namespace, vocab: int) -> dict[str, list[float]]:
    names = list(engines)
    results: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: first-call costs (and any compilation) off the clock
        run_once(engines[name], make_workload(4, (16, 64), (4, 8), vocab, 10_000))
    for rep in range(args.reps):
        work = make_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len), vocab,
                             args.seed + rep)
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            results[name].append(run_once(engines[name], work))
        print(f"rep {rep + 1}: " + "  ".join(f"{n} {results[n][-1]:.1f}" for n in names), flush=True)
    return results


def report(results: dict[str, list[float]]) -> None:
    names = list(results)
    base = results[names[0]]
    for name in names:
        ratios = [a / b for a, b in zip(results[name], base)]
        print(f"{name:16s} median {statistics.median(results[name]):8.1f} output tok/s   "
              f"vs {names[0]}: median x{statistics.median(ratios):.3f} "
              f"(per rep {', '.join(f'{r:.2f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF model directory or .gguf file")
    parser.add_argument("--variant", action="append", required=True, type=parse_variant,
                        help="name:KEY=V,key=v (repeat; the first is the baseline)")
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    common = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    engines = {v.name: (build(args.model, v, common), v) for v in args.variant}
    report(alternate(engines, args, prompt_vocab(args.model)))
