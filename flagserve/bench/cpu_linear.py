"""The native CPU linear's packings of one model's layers, by rows per step (issue 16).

Every layer's linears (q|k|v, o, gate|up with its SiLU, down) of the model's shape, each
layer its own random weights (so the step streams them from memory as a model's does), with
values of the chosen storage: `q4_1` / `q8_0` (gguf's quantizer, then packed as those blocks:
layers/cpu_quantized.py) or `bf16` / `f16` (such values, packed so). Each row count runs
the layers against the float32 packing of the same weights, alternating, best of --reps after
a warm-up pass, and prints ms per pass over all the layers and the ratio.

    python benchmarks/cpu_linear.py --model SmolLM2-135M-Instruct.Q4_1.gguf --storage q4_1
"""
from __future__ import annotations

import argparse
import time
from typing import Literal, get_args

import gguf
import numpy as np
import torch

from flagserve.bench.args import positive_int
from flagserve.layers.cpu_quantized import packed_blocks
from flagserve.models.config import load_model_config
from kernels import cpu_native

Storage = Literal["q4_1", "q8_0", "bf16", "f16"]
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}
ROWS = (1, 4, 8, 12, 16, 24, 32, 48, 64, 100, 256, 2048)


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """[N, K] of a layer's q|k|v, o, gate|up and down."""
    cfg = load_model_config(model)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return [(qkv, h), (h, d * cfg.num_attention_heads), (2 * i, h), (h, i)]


def weight_values(shape: tuple[int, int], storage: Storage, rng: np.random.Generator) -> torch.Tensor:
    """A float32 weight whose values `storage` holds exactly."""
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    if storage in HALF:
        return torch.from_numpy(values).to(HALF[storage]).float()
    kind = gguf.GGMLQuantizationType[storage.upper()]
    return torch.from_numpy(gguf.dequantize(gguf.quantize(values, kind), kind).reshape(shape).copy())


def packings(weight: torch.Tensor, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 packing, `storage`'s packing) of the same weight."""
    wide = cpu_native.pack_linear_weight(weight)
    narrow = (cpu_native.pack_linear_weight(weight.to(HALF[storage])) if storage in HALF
              else packed_blocks(weight))
    assert narrow is not None, f"{storage} values not found as such"
    return wide, narrow


def one_pass(layers, xs: dict[int, torch.Tensor], which: int) -> float:
    """Seconds for one pass of the rows xs (by width) over every layer's linears, packing
    `which`."""
    start = time.perf_counter()
    for layer in layers:
        for index, ((n, k), pair) in enumerate(layer):
            kernel = cpu_native.packed_linear_silu if index == 2 else cpu_native.packed_linear
            kernel(xs[k], pair[which], n, None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF directory or .gguf file (its shape)")
    parser.add_argument("--storage", choices=list(get_args(Storage)), default="q4_1")
    parser.add_argument("--rows", type=positive_int, nargs="+", default=list(ROWS))
    parser.add_argument("--layers", type=positive_int, default=None, help="default: the model's")
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    count = args.layers or load_model_config(args.model).num_hidden_layers
    shapes = layer_shapes(args.model)
    layers = [[(s, packings(weight_values(s, args.storage, rng), args.storage)) for s in shapes]
              for _ in range(count)]
    print(f"{count} layers of {args.model}'s linears ({shapes}), {torch.get_num_threads()} "
          f"threads, best of {args.reps}, ms per pass")
    print(f"| rows | float32 | {args.storage} | speed-up |\n|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        best = [float("inf"), float("inf")]
        for which in (0, 1):  # warm-up, off the clock: the first pass pages the rows in
            one_pass(layers, xs, which)
        for _ in range(args.reps):
            for which in (0, 1):  # alternated: the machine's speed drifts
                best[which] = min(best[which], one_pass(layers, xs, which))
        print(f"| {rows} | {best[0] * 1e3:.2f} | {best[1] * 1e3:.2f} | {best[0] / best[1]:.2f}x |",
              flush=True)
