"""Offline throughput: FlagServe vs HF transformers `generate` on the same random workload.

The workload follows nano-vllm's bench: N requests with random prompt lengths and random
max_tokens each, ignore_eos, on a random-weight model of a chosen size. HF runs as a user
would batch it: left-padded batches, max_new_tokens = the batch's largest request, and only the
tokens each request asked for count as output. Prints output tokens/s of each, the ratio, and
the share of engine step time spent outside the model forward.

    python benchmarks/throughput.py                     # CPU defaults, about a minute
    python benchmarks/throughput.py --num-seqs 256 --input-len 100 1024 --output-len 100 1024 \
        --hidden-size 1024 --layers 16 --dtype bfloat16  # a GPU-sized run
"""
import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass

import torch

from flagserve.models.config import load_model_config, transformers_location


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


def run_flagserve(model: str, work: Workload, args: argparse.Namespace, **engine_args) -> tuple[float, dict]:
    from flagserve import LLM, SamplingParams

    engine_args = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "attention_backend": args.backend, **engine_args}
    llm = LLM(model, **engine_args)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(work.prompts[:4], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    before = llm.llm_engine.get_stats()
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    step = stats.step_seconds - before.step_seconds
    forward = stats.forward_seconds - before.forward_seconds
    return elapsed, {"steps": stats.num_steps - before.num_steps, "step_seconds": step,
                     "forward_seconds": forward, "outside_forward_share": 1 - forward / step,
                     "preemptions": stats.num_preemptions}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model",
                        help="a local HF model directory or .gguf file "
                             "(default: a random model of the size below)")
    parser.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--hf-batch-size", type=int, default=0,
                        help="HF batch size (0: all requests at once)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from flagserve.models.tiny import make_tiny_model
            head_dim = args.hidden_size // args.heads
            model = str(make_tiny_model(tmp, arch=args.arch, seed=args.seed, hidden_size=args.hidden_size,
                                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                        num_key_value_heads=args.kv_heads, head_dim=head_dim,
                                        intermediate_size=args.intermediate_size,
                                        max_position_embeddings=4096))
        vocab = load_model_config(model).vocab_size
        work = make_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
        fs_time, fs_stats = run_flagserve(model, work, args)
        hf_time = None if args.skip_hf else run_hf(model, work, args)

    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU x{torch.get_num_threads()} threads")
    fs_tps = work.output_tokens / fs_time
    print(f"workload: {args.num_seqs} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
          f"outputs {args.output_len[0]}-{args.output_len[1]} tokens ({work.output_tokens} in all), "
          f"{args.dtype}, {device}")
    print(f"FlagServe          {fs_time:8.2f} s  {fs_tps:9.1f} output tok/s  "
          f"({fs_stats['steps']} steps, {fs_stats['outside_forward_share']:.1%} of step time "
          "outside the model forward)")
    result = {"args": vars(args), "device": device, "output_tokens": work.output_tokens,
              "flagserve_seconds": fs_time, "flagserve_output_tps": fs_tps, **fs_stats}
    if hf_time is not None:
        hf_tps = work.output_tokens / hf_time
        print(f"HF generate        {hf_time:8.2f} s  {hf_tps:9.1f} output tok/s")
        print(f"ratio              {fs_tps / hf_tps:8.2f} x")
        result.update(hf_seconds=hf_time, hf_output_tps=hf_tps, ratio=fs_tps / hf_tps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
