"""The baseline of the serving path: the same workload straight into LLMEngine, in this process.

Same arrival times, same concurrency limit, same definitions as the HTTP client: a request
starts when it is handed to the engine (prompts are tokenized beforehand, so tokenization is
part of what the HTTP path adds), a "chunk" is an output that carries text, and its time is
when step() returns it. The difference to the HTTP run is what Ray Serve, HTTP, SSE and
tokenization add.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from flagserve.bench.datasets import SampleRequest, warmup_samples
from flagserve.bench.metrics import RequestResult
from flagserve.config.schema import BenchEndpoint
from flagserve.entrypoints.openai.tokenizer import PromptTokenizer


def encode(tokenizer: PromptTokenizer, sample: SampleRequest, endpoint: BenchEndpoint) -> list[int]:
    """Token ids exactly as FlagServe's server makes them."""
    if endpoint == "chat":
        return tokenizer.encode_chat(sample.messages)
    return tokenizer.encode_prompts([sample.text])[0]


def bench_engine(engine: Any, samples: list[SampleRequest], offsets: list[float],
                 max_concurrency: int | None = None, endpoint: BenchEndpoint = "completions",
                 ignore_eos: bool = True, progress: bool = True, warmup: int = 1
                 ) -> tuple[list[RequestResult], float]:
    """Drive `engine` (an LLMEngine) with the workload; returns results and the duration."""
    from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams
    from flagserve.engine.structured_outputs.params import StructuredOutputsParams

    prompts = PromptTokenizer(engine.tokenizer)
    ids = [encode(prompts, s, endpoint) for s in samples]

    def params(sample: SampleRequest, prompt_len: int) -> SamplingParams:
        max_tokens = sample.output_len or engine.max_model_len - prompt_len
        schema = None if sample.schema is None else StructuredOutputsParams(json=sample.schema)
        return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              ignore_eos=ignore_eos, output_kind=RequestOutputKind.DELTA,
                              structured_outputs=schema)

    for i, sample in enumerate(warmup_samples(samples, warmup)):  # as the HTTP run's
        warm = encode(prompts, sample, endpoint)
        engine.add_request(f"warmup-{i}", warm, params(sample, len(warm)))
    while engine.has_unfinished():
        engine.step()
    return _drive(engine, ids, lambda i: params(samples[i], len(ids[i])), offsets,
                  max_concurrency, progress)


def _drive(engine: Any, ids: list[list[int]], params: Callable[[int], Any], offsets: list[float],
           max_concurrency: int | None, progress: bool) -> tuple[list[RequestResult], float]:
    """Request i (prompt ids[i], sampling params(i)) goes in at offsets[i]; every step's
    outputs are timed as the HTTP client times its chunks."""
    results = [RequestResult(success=False, prompt_len=len(p)) for p in ids]
    starts = [0.0] * len(ids)
    last = [0.0] * len(ids)
    pending = deque(sorted(range(len(ids)), key=lambda i: offsets[i]))
    active = 0
    bar = tqdm(total=len(ids), desc="in-process", unit="req", disable=not progress, smoothing=0)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while (pending and t0 + offsets[pending[0]] <= now
               and (not max_concurrency or active < max_concurrency)):
            i = pending.popleft()
            starts[i] = now
            results[i].start = now - t0
            engine.add_request(str(i), ids[i], params(i), arrival_time=time.time())
            active += 1
            now = time.perf_counter()
        if not engine.has_unfinished():
            if pending:
                time.sleep(max(0.0, t0 + offsets[pending[0]] - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = int(out.request_id)
            r = results[i]
            r.output_len += sum(len(c.token_ids) for c in out.outputs)
            if any(c.text for c in out.outputs):
                if not r.chunk_times:
                    r.ttft = now - starts[i]
                else:
                    r.itl.append(now - last[i])
                r.chunk_times.append(now - t0)
                last[i] = now
            if out.finished:
                active -= 1
                r.cached_tokens = out.num_cached_tokens
                r.success = bool(r.chunk_times)
                r.latency = last[i] - starts[i]
                r.error = "" if r.success else "no output chunk"
                bar.update(1)
    duration = time.perf_counter() - t0
    bar.close()
    return results, duration
