"""One engine's offline `LLM.generate`, driven over stdin/stdout by compare_vllm.py.

    python offline_worker.py flagserve|vllm MODEL_DIR

Loads the model once and prints `READY {"load_seconds": ...}`; then, for every JSON line
{"prompts": [[ids]], "max_tokens": [n]} on stdin, generates greedily with ignore_eos and
prints `RESULT {"seconds": s, "output_tokens": n}`. Imports only the engine it drives, so
it runs in vLLM's own interpreter too (vLLM is never a dependency of FlagServe).
"""
import json
import sys
import time


def load(engine: str, model: str):
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model, dtype="float32", seed=0)
        return llm, SamplingParams, lambda ids: [TokensPrompt(prompt_token_ids=p) for p in ids]
    from flagserve import LLM, SamplingParams

    return LLM(model, dtype="float32"), SamplingParams, lambda ids: ids


def main() -> None:
    if len(sys.argv) != 3:  # driven by compare_vllm.py, not by hand
        sys.exit(f"usage: {sys.argv[0]} flagserve|vllm MODEL  (requests as JSON lines on stdin; "
                 "benchmarks/compare_vllm.py runs it)")
    engine, model = sys.argv[1], sys.argv[2]
    start = time.perf_counter()
    llm, sampling_params, prompts_of = load(engine, model)
    print("READY " + json.dumps({"load_seconds": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        work = json.loads(line)
        params = [sampling_params(temperature=0, max_tokens=m, ignore_eos=True)
                  for m in work["max_tokens"]]
        start = time.perf_counter()
        outs = llm.generate(prompts_of(work["prompts"]), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
