"""Structured-outputs costs on SmolLM2 (CPU): grammar compile time (cold, cached) and the
per-step overhead of masking, as engine step time with and without a JSON-schema constraint.

.venv/bin/python benchmarks/structured_outputs.py
"""
import argparse
import json
import time

import torch

from flagserve import LLM, SamplingParams, StructuredOutputsParams
from flagserve.engine.structured_outputs.compiler import GrammarCompiler
from flagserve.models.packaged import smollm2_gguf
from kernels import cpu_native
from kernels.sampling import apply_token_bitmask_torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "email", "tags", "address"]}


def compile_times(llm: LLM) -> None:
    # The compiler the grammar process runs, here in this process to time it.
    engine = llm.llm_engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               sorted(engine.eos_token_ids))
    for label, schema in [("cold (vocabulary scan + compile)", SCHEMA),
                          ("another schema", {**SCHEMA, "required": ["name"]}), ("cached", SCHEMA)]:
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        compiler.submit(params.kind, params.spec()).result()
        print(f"compile {label}: {1000 * (time.perf_counter() - start):.2f} ms")


def step_time(llm: LLM, constrained: bool, batch: int = 8, tokens: int = 48) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"{constrained}-{i}", "Write a person as JSON.", params)
    times, fill = [], []
    bitmask = engine.structured.bitmask

    def timed(seqs):
        start = time.perf_counter()
        out = bitmask(seqs)
        fill.append(time.perf_counter() - start)
        return out

    engine.structured.bitmask = timed
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    del engine.structured.bitmask
    if constrained:
        print(f"bitmask fill (matchers sync + fill), batch {batch}: "
              f"{1000 * sorted(fill)[len(fill) // 2]:.3f} ms median per step")
    return 1000 * sorted(times[2:])[len(times[2:]) // 2]  # median decode step, ms


def mask_cost(vocab: int, batch: int = 8) -> None:
    logits = torch.randn(batch, vocab)
    bits = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    impls = [("torch", apply_token_bitmask_torch)]
    if cpu_native.available():
        impls.append(("native", cpu_native.apply_token_bitmask_cpu))
    for name, apply in impls:
        start = time.perf_counter()
        for _ in range(100):
            apply(logits, bits)
        print(f"apply_token_bitmask [{batch} x {vocab}] {name}: "
              f"{10 * (time.perf_counter() - start):.3f} ms")


def main() -> None:
    # No options; --help says what it does instead of running it.
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    llm = LLM(str(smollm2_gguf()))
    compile_times(llm)
    step_time(llm, False, 2, 8)  # warm-ups: the model, and the grammar process's start
    step_time(llm, True, 2, 8)
    constrained, plain = step_time(llm, True), step_time(llm, False)
    print(f"median step, batch 8: plain {plain:.2f} ms, json-schema constrained {constrained:.2f} ms "
          f"(+{constrained - plain:.2f} ms, {100 * (constrained / plain - 1):.1f}%)")
    mask_cost(llm.llm_engine.model_config.vocab_size)
    print(json.dumps(llm.generate(["Write a person as JSON."], SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        use_tqdm=False)[0].outputs[0].text))


if __name__ == "__main__":
    main()
