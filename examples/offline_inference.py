"""Offline batched generation with FlagServe's engine, as with vLLM's `LLM`.

    python examples/offline_inference.py                 # the built-in tiny model (created if missing)
    python examples/offline_inference.py --model /path/to/Qwen2.5-7B-Instruct --dtype bfloat16
"""
import argparse

from flagserve import LLM, SamplingParams
from flagserve.models.tiny import ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local HF model directory (default: the built-in tiny model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(ensure_tiny_model())

    llm = LLM(model=model, dtype=args.dtype)
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "The future of AI is",
        "In the kitchen we cook rice and beans because",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens, logprobs=1)
    for params in (greedy, sampled):
        for out in llm.generate(prompts, params):
            comp = out.outputs[0]
            print(f"{out.prompt!r} -> {comp.text!r}  [{len(comp.token_ids)} tokens, {comp.finish_reason}]")
    stats = llm.llm_engine.get_stats()
    print(f"prefix cache: {stats.prefix_cache_hits}/{stats.prefix_cache_queries} prompt tokens hit; "
          f"{stats.generation_tokens} tokens generated in {stats.num_steps} steps")
    print("(The built-in model has random weights: its text is gibberish by design.)")


if __name__ == "__main__":
    main()
