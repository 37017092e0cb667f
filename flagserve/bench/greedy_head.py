"""The greedy LM head against the float32 head, by rows per step (issue 16).

A random LM head of the model's shape ([vocab, hidden], values of --storage as in
cpu_linear.py: `q8_0` is SmolLM2's head, which the engine also packs as Q8_0 blocks for steps
of few rows) and random input rows. Each row count times, alternating, best of --reps: the
engine's float32 head plus argmax (what a greedy step without the greedy head runs) and the
greedy head with each approximation asked for (layers/greedy_head.py; its logits, screen and
recompute). By default (cold; --hot: not) a buffer larger than the caches is streamed before each
call, as a decode step's layers evict the head between steps. Random inputs leave more
candidates than a model's hidden states do (near-ties among random logits), so the greedy
head's figures are if anything pessimistic. Prints ms per call and the float32 head's time
over each approximation's.

    python benchmarks/greedy_head.py --model SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import time
from typing import get_args

import numpy as np
import torch

from flagserve.bench.args import positive_int
from flagserve.bench.cpu_linear import Storage, weight_values
from flagserve.layers.cpu_matmul import pack_weight
from flagserve.layers.greedy_head import Approximation, GreedyHead
from flagserve.models.config import load_model_config
from kernels import cpu_native

ROWS = (1, 4, 16, 32, 64, 100, 256)
COLD_BYTES = 256 << 20


def timed(call, flush: torch.Tensor | None) -> float:
    if flush is not None:
        flush.add_(1.0)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF directory or .gguf file (its shape)")
    parser.add_argument("--storage", choices=[s for s in get_args(Storage) if s != "q4_1"],
                        default="q8_0")
    parser.add_argument("--approximations", nargs="+", choices=list(get_args(Approximation)),
                        default=["int8"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--reps", type=positive_int, default=6)
    parser.add_argument("--hot", action="store_true", help="no buffer streamed between calls")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = load_model_config(args.model)
    shape = (cfg.vocab_size, cfg.hidden_size)
    weight = weight_values(shape, args.storage, np.random.default_rng(args.seed))
    head = pack_weight(weight, "native")
    greedy = {kind: GreedyHead.build(weight, cfg.vocab_size, kind) for kind in args.approximations}
    flush = None if args.hot else torch.zeros(COLD_BYTES // 4)
    print(f"LM head {list(shape)} of {args.model} ({args.storage} values), "
          f"{torch.get_num_threads()} threads, {'hot' if args.hot else 'cold'}, best of "
          f"{args.reps}, ms per call")
    kinds = list(greedy)
    print("| rows | float32 head + argmax | " + " | ".join(kinds) + " | " +
          " | ".join(f"float32 / {k}" for k in kinds) + " |")
    print("|---" * (2 + 2 * len(kinds)) + "|")
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
            calls = [lambda x=x: cpu_native.argmax_cpu(head(x, None))]
            calls += [lambda x=x, g=greedy[k]: g(x) for k in kinds]
            for call in calls:  # first calls allocate: not timed
                call()
            best = [float("inf")] * len(calls)
            for _ in range(args.reps):
                for i, call in enumerate(calls):  # alternated: the machine's speed drifts
                    best[i] = min(best[i], timed(call, flush))
            print(f"| {rows} | " + " | ".join(f"{b * 1e3:.2f}" for b in best) + " | " +
                  " | ".join(f"{best[0] / b:.2f}x" for b in best[1:]) + " |", flush=True)
