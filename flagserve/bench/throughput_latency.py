"""Batch-1 decode latency: one request alone, milliseconds per output token after the first;
optionally a torch profile of some of those steps (or of a throughput run's batch decoding
together), so that a run on a lent GPU says where the time goes (host or device, which ops)
without another run."""
import time

import torch

from flagserve.bench.throughput_phases import prefilling
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
    engine = _prefilled(llm, prompt, steps + 1)
    return _profiled_steps(engine, steps, rows)


def profile_batch_decode(llm, prompts: list[list[int]], steps: int, rows: int = 25) -> str:
    """The same table for `steps` steps of all `prompts` decoding together (after every prompt
    is prefilled: steps of the throughput run's batch); the requests are aborted afterwards."""
    return _profile_batch(llm, prompts, steps, rows, decode=True)


def profile_batch_prefill(llm, prompts: list[list[int]], steps: int, rows: int = 25) -> str:
    """The same table for the first `steps` steps of all `prompts` added at once: chunked
    prefill steps of the step's token budget (steps with prompt tokens run without CUDA graphs,
    so this is where a GPU's host time per layer shows). Each prompt is rotated by one token:
    the timed run left the prompts themselves in the prefix cache, which would skip most of
    the work profiled."""
    rotated = [prompt[1:] + prompt[:1] for prompt in prompts]
    return _profile_batch(llm, rotated, steps, rows, decode=False)


def _profile_batch(llm, prompts: list[list[int]], steps: int, rows: int, decode: bool) -> str:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    scheduler = engine.scheduler
    while decode and (scheduler.waiting or prefilling(scheduler.running)):
        engine.step()
    table = _profiled_steps(engine, steps, rows)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return table


def _profiled_steps(engine, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            if not engine.has_unfinished():
                break
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
