"""Batch-1 decode latency: one request alone, milliseconds per output token after the first."""
import time

from flagserve.engine.sampling_params import SamplingParams


def decode_latency(llm, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """(seconds per decode step, decode steps) of `prompt` alone; its prefill steps (up to the
    first token) are not timed. Warm up first: the first run compiles and allocates."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("latency", prompt, params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1), steps
