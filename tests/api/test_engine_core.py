"""The engine in a child process of its replica (engine_core.EngineProcess) against LLMEngine
in this process: same tokens, aborts free the request, a dead child fails every stream."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from pathlib import Path

import psutil
import pytest

from flagserve.engine.async_engine import AsyncEngine
from flagserve.engine.core.loop import AddRequest, EngineDeadError
from flagserve.engine.core.process import STOP_TIMEOUT_S, EngineProcess
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.sampling_params import SamplingParams
from flagserve.entrypoints.llm import LLM


def _args(model: str) -> EngineArgs:
    return EngineArgs(model=model, dtype="float32", max_model_len=256, max_num_seqs=8,
                      cpu_kv_cache_space_gib=0.05)


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    ids, text = [], ""
    async for out in engine.generate(rid, prompt, params):
        ids += out.outputs[0].token_ids
        text += out.outputs[0].text
    return ids, text


def test_engine_process_matches_in_process_engine(llama_path):
    prompts = [[1, 5, 9, 13], list(range(3, 40)), [7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    local = LLM(llama_path, dtype="float32", max_model_len=256, max_num_seqs=8,
                cpu_kv_cache_space_gib=0.05)
    expected = [(o.outputs[0].token_ids, o.outputs[0].text)
                for o in local.generate(prompts, params, use_tqdm=False)]
    engine = AsyncEngine(EngineProcess(_args(llama_path)))
    try:
        assert engine.core.max_model_len == 256
        # xgrammar is loaded at start: importing it for the first constrained request stalled
        # the step loop (every stream) for 0.1-0.3 s.
        maps = Path(f"/proc/{engine.core.proc.pid}/maps")
        assert not maps.exists() or "xgrammar" in maps.read_text()

        async def main():
            got = await asyncio.gather(*(_collect(engine, f"r{i}", p, params)
                                         for i, p in enumerate(prompts)))
            assert [(list(i), t) for i, t in got] == [(list(i), t) for i, t in expected]
            with pytest.raises(ValueError, match="max_model_len"):
                await _collect(engine, "too-long", [1] * 300, params)
            # A request that cannot be pickled to the child (nested past the recursion limit)
            # fails alone; the writer thread lives on for the next one.
            deep = nested = []
            for _ in range(5000):
                nested.append([])
                nested = nested[0]
            with pytest.raises(ValueError, match="cannot be sent to the engine process"):
                engine.core.send(AddRequest("deep", deep, params, 0.0))
            assert (await _collect(engine, "after", *prompts[:1], params)) == expected[0]
            # A consumer that goes away aborts its request: the engine becomes idle.
            gen = engine.generate("cut", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()
            for _ in range(100):
                if engine.stats.num_running == 0 and engine.stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats.num_running == 0

        asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.core.proc.returncode == 0


def test_engine_process_death_fails_streams(llama_path):
    engine = AsyncEngine(EngineProcess(_args(llama_path)))
    try:
        async def main():
            gen = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            await gen.__anext__()
            os.kill(engine.core.proc.pid, signal.SIGKILL)
            # admitted or refused (the death may not be reported yet): it fails, never hangs
            late = engine.generate("late", [1, 2], SamplingParams(max_tokens=4))
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(late.__anext__(), 30)
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in gen:
                    pass
            assert not engine.alive and not engine.core.accepting

        asyncio.run(main())
    finally:
        engine.shutdown()


def test_engine_process_reports_load_failure(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineProcess(EngineArgs(model=str(tmp_path / "missing"), dtype="float32"))


def _engine_children() -> list[psutil.Process]:
    """This process's engine children. A child just spawned may not have exec'd yet (its
    cmdline still this process's): looked at again for a while rather than missed."""
    deadline = time.monotonic() + 10
    while True:
        found = [p for p in psutil.Process().children()
                 if "flagserve.engine.core.process" in " ".join(p.cmdline())]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_the_replicas_own_start_runs_while_the_child_loads(llama_path):
    """`meanwhile` (the ingress's tokenizers and imports) runs once the child is spawned and
    before it is ready; when it fails, the child is killed and the error is the replica's. An
    engine stopped before it ever stepped (the replica failed later on) stops at once."""
    seen = []
    engine = EngineProcess(_args(llama_path), lambda: seen.extend(_engine_children()))
    started = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - started < STOP_TIMEOUT_S / 2 and engine.proc.returncode == 0
    assert [p.pid for p in seen] == [engine.proc.pid]

    def fails():
        seen[:] = _engine_children()
        raise ValueError("no tokenizer here")

    with pytest.raises(ValueError, match="no tokenizer here"):
        EngineProcess(_args(llama_path), fails)
    assert len(seen) == 1 and not seen[0].is_running()

def test_wire_round_trips_every_field():
    import dataclasses

    from flagserve.engine.core import wire as engine_wire
    from flagserve.engine.core.loop import StepResult
    from flagserve.engine.kv_transfer.handoff import KVLayout, RequestHandoff
    from flagserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from flagserve.engine.stats import EngineStats

    # Every field set to a distinct non-default value, so a field the wire drops shows.
    def filled(cls, **given):
        values = {}
        for i, f in enumerate(dataclasses.fields(cls)):
            values[f.name] = given.get(f.name, i + 0.5 if "float" in str(f.type) else i + 1)
        return cls(**values)

    lp = [{7: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, None)}]
    completion = CompletionOutput(1, "text", [7, 8], -2.0, lp, "stop", "</s>")
    out = RequestOutput("r1", "prompt", [1, 2, 3], [completion, CompletionOutput(0, "", [], None, None)],
                        True, filled(RequestMetrics), 3, "KV transfer failed", [None, *lp])
    stats = filled(EngineStats)
    handoff = filled(RequestHandoff, params=SamplingParams(seed=3), seqs=[], layout=filled(KVLayout))
    result = StepResult([out], stats, 123.5, [("bad", ValueError("too long"))], [handoff], ["gone"])
    back = engine_wire.Decoder().decode(pickle.loads(engine_wire.Encoder().encode(result)))
    assert back.outputs == result.outputs and back.stats == stats and back.time == 123.5
    assert back.handoffs == [handoff] and back.aborted == ["gone"]
    assert back.rejected[0][0] == "bad" and str(back.rejected[0][1]) == "too long"


def test_wire_sends_a_prompt_once_and_forgets_it_with_its_request():
    from flagserve.engine.core import wire as engine_wire
    from flagserve.engine.core.loop import StepResult
    from flagserve.engine.outputs import CompletionOutput, RequestOutput
    from flagserve.engine.stats import EngineStats

    stats = EngineStats(*range(11))
    encoder, decoder = engine_wire.Encoder(), engine_wire.Decoder()

    def step(*outs: tuple[str, bool]) -> tuple[bytes, StepResult]:
        outputs = [RequestOutput(r, f"text of {r}", [ord(c) for c in r],
                                 [CompletionOutput(0, "x", [5], None, None)], finished)
                   for r, finished in outs]
        data = encoder.encode(StepResult(outputs, stats, 1.0))
        back = decoder.decode(pickle.loads(data))
        assert back.outputs == outputs  # the prompt is there every time on this side
        return data, back

    first, _ = step(("ab", False), ("cd", False))
    later, _ = step(("ab", False), ("cd", True))
    assert b"text of ab" in first and b"text of ab" not in later and b"text of cd" not in later
    step(("ab", True))
    assert not decoder._prompts and not encoder._sent  # noqa: SLF001 - both forgot them
    # An aborted request: forgotten on both sides; a late output of it decodes, promptless.
    step(("ef", False))
    encoder.forget("ef")
    decoder.forget("ef")
    assert not decoder._prompts and not encoder._sent  # noqa: SLF001
    late = RequestOutput("ef", "text of ef", [1], [CompletionOutput(0, "y", [6], None, None)], False)
    encoder._sent.add("ef")  # noqa: SLF001 - as if encoded before the abort arrived
    back = decoder.decode(pickle.loads(encoder.encode(StepResult([late], stats, 2.0))))
    assert back.outputs[0].prompt_token_ids == [] and back.outputs[0].outputs[0].text == "y"


def test_step_loop_publishes_the_stats_of_a_step_that_leaves_it_idle():
    """A prefill engine whose last KV transfer ends in a step with no outputs: that step's
    stats (bytes sent, blocks freed) are published, not left at the previous step's."""
    from flagserve.engine.core.loop import run_steps

    class Exporting:  # busy for two steps without outputs, then idle
        def __init__(self):
            self.steps = 0

        def has_unfinished(self):
            return self.steps < 2

        def step(self):
            self.steps += 1
            return []

        def take_handoffs(self):
            return []

        def get_stats(self):
            return self.steps

    published, engine = [], Exporting()
    run_steps(engine, lambda _timeout: [], lambda result: published.append(result.stats),
              lambda: engine.steps >= 2)
    assert published == [2]


def test_priority_reaches_the_engine_process(llama_path):
    """AsyncEngine.generate(priority=) crosses the pipe: one sequence at a time, the lowest
    priority value is served first whatever the arrival order."""
    args = EngineArgs(model=llama_path, dtype="float32", max_model_len=256, max_num_seqs=1,
                      cpu_kv_cache_space_gib=0.05, scheduling_policy="priority")
    engine = AsyncEngine(EngineProcess(args))
    try:
        async def one(rid: str, priority: int, max_tokens: int = 4) -> float:
            asked = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for out in engine.generate(rid, [1, 5, 9], asked, priority=priority):
                if out.finished:
                    return out.metrics.first_scheduled_time
            raise AssertionError(f"{rid} ended without a final output")

        async def main():
            # a first request holds the one slot (long enough) while the others queue behind it
            first = asyncio.ensure_future(one("first", 0, max_tokens=200))
            await asyncio.sleep(0.05)
            times = await asyncio.gather(*(one(f"p{p}", p) for p in (3, -1, 2)))
            await first
            return times
        late, early, middle = asyncio.run(main())
        assert early < middle < late
    finally:
        engine.shutdown()
