"""FlagServe vs vLLM's CPU build, offline, the same workload in the same run, alternating
(issue 16's comparison; vLLM runs in its own interpreter and is never our dependency).

    python benchmarks/compare_vllm.py --vllm-python /tmp/vllm-venv/bin/python

Both engines load one HF directory in float32: a .gguf model (the default: SmolLM2's) is
converted once by transformers into ~/.cache/flagserve/hf-from-gguf/. Each engine runs in a
worker process of its own interpreter (benchmarks/offline_worker.py), started once; every
repetition draws fresh random prompts (a repeated prompt would measure the prefix cache) and
sends them to one engine, then the other, the order alternating. vLLM is set up the way its
CPU guide says: tcmalloc and Intel OpenMP preloaded when found, its threads bound to the
cores (VLLM_CPU_OMP_THREADS_BIND), VLLM_CPU_KVCACHE_SPACE GiB of KV cache. Each repetition
also prints its compute floor (its matmuls' FLOPs at this CPU's float32 matmul rate,
throughput_roofline.py) and the share of it each engine reached: how far from this machine's
limit both run, not only how they compare.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from flagserve.bench.args import positive_int, vllm_python
from flagserve.bench.throughput import make_workload, prompt_vocab
from flagserve.bench.throughput_roofline import (
    compute_floor_seconds,
    matmul_flops,
    measure_peak_tflops,
)
from flagserve.engine.cpu_runtime import (
    intel_openmp_library,
    preload_env,
    runtime_env,
    tcmalloc_library,
)
from flagserve.models.cache import cache_root
from flagserve.models.config import load_model_config

WORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "offline_worker.py"
CACHE = cache_root() / "hf-from-gguf"


def hf_directory(model: str) -> str:
    """`model` itself, or for a .gguf file its float32 HF form (converted once)."""
    if not model.endswith(".gguf"):
        return model
    out = CACHE / Path(model).stem
    if not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {model} to {out} (once) ...", flush=True)
        directory, name = os.path.split(model)
        AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype="float32")
        # Dequantized to float32 at load: nothing of the GGUF quantization is left to save.
        hf.hf_quantizer = None
        vars(hf.config).pop("quantization_config", None)
        hf.save_pretrained(out)
    return str(out)


# FlagServe's own runtime settings (cpu_runtime.runtime_env) stay out of vLLM's process.
OURS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_SPINCOUNT",
        "LD_PRELOAD")


def vllm_env(python: str, kv_gib: int) -> dict[str, str]:
    cores = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}
    prefix = str(Path(python).resolve().parents[1])
    return {**env, **preload_env(env, tcmalloc_library() + intel_openmp_library(prefix))}


class Worker:
    def __init__(self, name: str, python: str, model: str, env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen([python, str(WORKER), name, model], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.load_seconds = self._answer("READY")["load_seconds"]

    def _answer(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"the {self.name} worker exited with code {self.proc.wait()}")

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> float:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer("RESULT")
        assert answer["output_tokens"] == sum(max_tokens), answer
        return answer["output_tokens"] / answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def alternate(workers: list[Worker], args: argparse.Namespace, model: str) -> dict[str, list[float]]:
    tps: dict[str, list[float]] = {w.name: [] for w in workers}
    for w in workers:  # warm-up, off the clock
        w.run([[5, 6, 7, 8]] * 4, [4] * 4)
    cfg, vocab = load_model_config(model), prompt_vocab(model)
    peak = measure_peak_tflops(torch.device("cpu"), torch.float32)  # both workers idle
    print(f"this CPU's float32 matmul rate: {peak * 1e3:.0f} GFLOP/s", flush=True)
    for rep in range(args.reps):
        work = make_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len), vocab,
                             args.seed + rep)
        for w in workers if rep % 2 == 0 else workers[::-1]:
            tps[w.name].append(w.run(work.prompts, work.max_tokens))
        prompt_lens = [len(p) for p in work.prompts]
        floor = compute_floor_seconds(matmul_flops(cfg, prompt_lens, work.max_tokens), peak)
        shares = "  ".join(f"{n} {floor / (work.output_tokens / v[-1]):.0%}" for n, v in tps.items())
        print(f"rep {rep + 1}: " + "  ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in tps.items())
              + f"  (compute floor {floor:.1f} s, reached: {shares})", flush=True)
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, type=vllm_python,
                        help="the interpreter of vLLM's venv")
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2's GGUF)")
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--num-seqs", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, nargs=2, default=[32, 256])
    parser.add_argument("--output-len", type=positive_int, nargs=2, default=[32, 256])
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from flagserve.models.packaged import smollm2_gguf

    model = hf_directory(args.model or str(smollm2_gguf()))
    # Only the FlagServe worker starts with the engine's runtime, never this process: with
    # OMP_PLACES set, OpenMP pins the thread that loads it to the first place, and children
    # inherit that affinity (both workers ran on one core until 2026-11-24).
    ours = {**os.environ, **runtime_env(os.environ)}
    workers = [Worker("flagserve", sys.executable, model, ours),
               Worker("vllm", args.vllm_python, model, vllm_env(args.vllm_python, args.kv_cache_gib))]
    print("load: " + ", ".join(f"{w.name} {w.load_seconds:.1f} s" for w in workers), flush=True)
    try:
        tps = alternate(workers, args, model)
    finally:
        for w in workers:
            w.close()
    ratios = [a / b for a, b in zip(tps["flagserve"], tps["vllm"])]
    print(f"median output tok/s: flagserve {statistics.median(tps['flagserve']):.1f}, "
          f"vllm {statistics.median(tps['vllm']):.1f}; flagserve / vllm per rep "
          f"{', '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
