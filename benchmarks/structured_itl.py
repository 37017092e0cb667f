"""ITL of constrained (dataset json-schema) vs unconstrained (random) decoding, in process.

The same prompts and lengths, 32 requests at a time, ignore_eos, greedy; each schema's grammar
is compiled by a first pass of 4 requests, so the figures are the per-step masking cost only.
Ends with the ratio of the best (lowest) median ITL of each over the passes.

The engine runs with the OpenMP settings of a served engine process (cpu_runtime's thread
plan: a short spin), applied before torch loads. With GNU OpenMP's default (~7 ms) spin the
engine's second thread spins on the core the grammar process needs: --omp-default keeps
that default, to measure it.

    .venv/bin/python benchmarks/structured_itl.py <model dir> [--reps 2] [--omp-default]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from flagserve.engine.cpu_runtime import engine_thread_plan

if "--omp-default" not in sys.argv:  # before torch is imported: OpenMP reads it once
    os.environ.update(engine_thread_plan().env(os.environ))

from flagserve.bench.datasets import build_dataset  # noqa: E402 - after the OpenMP settings
from flagserve.bench.inprocess import bench_engine
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.llm_engine import LLMEngine
from flagserve.models.tokenizer import load_tokenizer

CONCURRENCY, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 128, 64, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--omp-default", action="store_true",
                   help="keep OpenMP's default waits (spinning) instead of the served engine's")
    args = p.parse_args()
    tok = load_tokenizer(args.model)  # an HF directory or a .gguf file
    engine = LLMEngine(EngineArgs(model=args.model, dtype="float32", max_num_seqs=CONCURRENCY))
    medians: dict[str, list[float]] = {"random": [], "json-schema": []}
    for rep in range(args.reps):
        for name in ("random", "json-schema"):  # interleaved: drift in the machine hits both
            samples = build_dataset(name, tok, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, seed=rep)
            bench_engine(engine, samples[:4], [0.0] * 4, max_concurrency=CONCURRENCY, progress=False)
            res, dur = bench_engine(engine, samples, [0.0] * len(samples),
                                    max_concurrency=CONCURRENCY, progress=False)
            assert all(r.success and r.output_len == OUTPUT_LEN for r in res)
            itl = [x for r in res for x in r.itl]
            medians[name].append(statistics.median(itl))
            print(f"{name:12s} rep {rep}: ITL mean {statistics.mean(itl) * 1e3:.3f} ms, median "
                  f"{medians[name][-1] * 1e3:.3f} ms, {NUM_PROMPTS * OUTPUT_LEN / dur:.0f} tok/s",
                  flush=True)
    # The least disturbed pass of each: on a shared machine noise only ever adds time.
    base, constrained = min(medians["random"]), min(medians["json-schema"])
    print(f"ITL median, best pass: random {base * 1e3:.3f} ms, json-schema {constrained * 1e3:.3f} ms: "
          f"{constrained / base:.3f}x ({(constrained / base - 1) * 100:+.1f}%)")
    stats = engine.get_stats()
    print(f"grammar compile requests {stats.structured_output_compile_requests}, "
          f"cache hits {stats.structured_output_cache_hits}")


if __name__ == "__main__":
    main()
