"""Batch-1 decode latency: one request alone, milliseconds per output token after the first;
optionally a torch profile of some of those steps, so that a run on a lent GPU says where the
time goes (host or device, which ops) without another run."""
import time

import torch

from flagserve.engine.sampling_params import SamplingParams


def decode_latency(llm, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """(seconds per decode step, decode steps) of `prompt` alone; its prefill steps (up to the
    first token) are not timed. Warm up first: the first run compiles and allocates."""
    engine = _prefilled(llm, prompt, new_tokens)
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1), steps


def profile_decode(llm, prompt: list[int], steps: int, rows: int = 25) -> str:
    """torch.profiler's table of `steps` decode steps of `prompt` alone (CUDA kernels too on a
    GPU), by self time on the device where there is one: the ops worth making faster."""
    from torch.profiler import ProfilerActivity, profile

    engine = _prefilled(llm, prompt, steps + 1)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        while engine.has_unfinished():
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def _prefilled(llm, prompt: list[int], new_tokens: int):
    """The engine with `prompt` added and stepped until its first token."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("latency", prompt, params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    return engine
