"""Small pieces without Ray: hostfile parsing, the async engine bridge, metrics rendering."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from flagserve.config.hostfile import HostfileError, parse_hostfile
from flagserve.engine.async_engine import AsyncEngine
from flagserve.engine.core.loop import StepResult
from flagserve.engine.core.thread import EngineThread
from flagserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flagserve.engine.stats import EngineStats
from flagserve.serve.metrics import EngineMetrics, render


def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# head\n10.0.0.1 slots=8 type=gpu\n\n10.0.0.2 slots=4 ssh_port=2222 user=u # x\n"
                    "10.0.0.3 slots=16 type=cpu\n")
    hosts = parse_hostfile(path)
    assert [(h.address, h.num_gpus, h.ssh_port, h.user) for h in hosts] == [
        ("10.0.0.1", 8, None, None), ("10.0.0.2", 4, 2222, "u"), ("10.0.0.3", 0, None, None)]
    for bad in ("10.0.0.1", "10.0.0.1 slots=x", "10.0.0.1 slots=2 gpus=2", "10.0.0.1 slots=\u00b2",
                "10.0.0.1 slots=2 ssh_port=\u0662\u0662"):  # digits that str.isdigit() takes
        path.write_text(bad + "\n")
        with pytest.raises(HostfileError, match=":1:"):
            parse_hostfile(path)
    path.write_bytes(b"\xff\xfe10.0.0.1 slots=1\n")
    with pytest.raises(HostfileError, match="not UTF-8"):
        parse_hostfile(path)


class FakeEngine:
    """Emits one token per step per request, like LLMEngine with DELTA outputs."""

    max_model_len = 64
    prompt_vocab_size = 100

    class model_config:  # noqa: N801 - LLMEngine's attribute
        vocab_size = 100

    def __init__(self, steps: int = 5):
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = steps

    def shutdown(self):
        pass

    def add_request(self, rid, prompt, params, arrival_time=None, priority=0):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests[rid] = 0

    def abort(self, rid):
        if self.requests.pop(rid, None) is None:
            return False
        self.aborted.append(rid)
        return True

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.001)
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= (10_000 if rid == "cut" else self.steps)
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "x", [7], None, None, "length" if done else None)], done, RequestMetrics(0.0)))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self):
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)

    def take_handoffs(self):
        return []  # no prefill/decode disaggregation here


def test_async_engine_streams_errors_and_aborts():
    from flagserve.engine.sampling_params import SamplingParams
    fake = FakeEngine()
    engine = AsyncEngine(EngineThread(fake))

    async def main():
        texts = await asyncio.gather(*(collect(f"r{i}") for i in range(4)))
        assert texts == ["xxxxx"] * 4
        with pytest.raises(ValueError, match="empty"):
            await collect("bad", prompt=[])
        gen = engine.generate("cut", [1], SamplingParams())
        await gen.__anext__()
        await gen.aclose()  # the consumer goes away
        for _ in range(50):
            if "cut" in fake.aborted:
                break
            await asyncio.sleep(0.02)
        assert fake.aborted == ["cut"]

    async def collect(rid, prompt=(1,)):
        outs = [o async for o in engine.generate(rid, list(prompt), SamplingParams())]
        return "".join(o.outputs[0].text for o in outs)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_metrics_render_vllm_names():
    m = EngineMetrics()
    out = RequestOutput("a", None, [1, 2], [CompletionOutput(0, "x", [3], None, None, "stop")],
                        True, RequestMetrics(arrival_time=1.0, first_token_time=1.5))
    stats = EngineStats(0, 0, 0.25, 10, 4, 2, 1, 0, 1, 0.1, 0.1)
    m.on_step(StepResult([out], stats, 2.0))
    text = render({("tiny", "0"): m.snapshot(stats)}).decode()
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 4.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.5' in text


def test_every_sequence_of_an_n_request_is_counted_by_its_finish():
    """DELTA outputs: a choice that ends early is in that step's output only, not the last."""
    m = EngineMetrics()
    stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)
    first = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [3], None, None, "stop"),
                                           CompletionOutput(1, "b", [4], None, None)],
                          False, RequestMetrics(arrival_time=1.0, first_token_time=1.5))
    last = RequestOutput("r", None, [1], [CompletionOutput(1, "c", [5], None, None, "length")],
                         True, RequestMetrics(arrival_time=1.0, first_token_time=1.5))
    m.on_step(StepResult([first], stats, 2.0))
    m.on_step(StepResult([last], stats, 2.5))
    assert m.snapshot(stats)["success"] == {"stop": 1, "length": 1}


def test_a_stream_closed_early_is_one_abort_with_one_first_token_in_metrics():
    """The engine keeps stepping a request until the abort reaches it: those outputs are not
    a second first token, and the request leaves nothing behind in the metrics."""
    from flagserve.engine.sampling_params import SamplingParams
    fake, metrics = FakeEngine(), EngineMetrics()
    engine = AsyncEngine(EngineThread(fake), on_step=metrics.on_step)

    async def main():
        gen = engine.generate("cut", [1], SamplingParams())
        for _ in range(3):
            await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if fake.aborted:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # any step still in flight has been published

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    snap = metrics.snapshot(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0))
    assert snap["success"] == {"abort": 1}
    assert sum(snap["histograms"]["vllm:time_to_first_token_seconds"][0]) == 1
    assert metrics._seen == {}  # noqa: SLF001 - the leak this guards against


def test_a_replica_that_stops_pushing_leaves_metrics_with_a_log_line(caplog, monkeypatch):
    from flagserve.serve import metrics_hub

    hub, clock = metrics_hub.MetricsHub(), [100.0]
    monkeypatch.setattr(metrics_hub, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    snapshot = EngineMetrics().snapshot(EngineStats(0, 0, 0.25, 10, 4, 2, 1, 0, 1, 0.1, 0.1))
    asyncio.run(hub.push(("tiny", "a"), snapshot))
    clock[0] += metrics_hub.STALE_AFTER_S - 1
    asyncio.run(hub.push(("tiny", "b"), snapshot))
    assert 'engine="a"' in asyncio.run(hub.render()).decode()
    clock[0] += 2  # a: STALE_AFTER_S + 1 since its push; b: 2
    text = asyncio.run(hub.render()).decode()
    assert 'engine="a"' not in text and 'engine="b"' in text
    assert "replica a dropped" in caplog.text


def test_grammar_cache_hit_rate_reaches_metrics(llama_path):
    """The compiler counts what it is asked and what its LRU answers; /metrics shows both."""
    from flagserve import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(llama_path, dtype="float32")
    regex = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r))
             for r in (r"a{1,3}", r"b{1,3}", r"a{1,3}")]
    llm.generate(["x"] * 3, regex, use_tqdm=False)
    llm.generate(["y"], regex[1], use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert (stats.structured_output_compile_requests, stats.structured_output_cache_hits) == (4, 2)
    text = render({("tiny", "0"): EngineMetrics().snapshot(stats)}).decode()
    assert 'flagserve:structured_output_compile_requests_total{engine="0",model_name="tiny"} 4.0' in text
    assert 'flagserve:structured_output_cache_hits_total{engine="0",model_name="tiny"} 2.0' in text


def test_chunks_that_arrive_together_leave_as_one_sse_event():
    import json

    from flagserve.entrypoints.openai.engine_client import EngineChunk
    from flagserve.entrypoints.openai.responses import ChatFormat, CompletionFormat, Header
    from flagserve.entrypoints.openai.streams import batches

    def chunk(text, index=0, finish=None):
        return EngineChunk([CompletionOutput(index, text, [ord(c) for c in text], None, None, finish)],
                           3, 0, finish is not None)

    async def stream(*chunks, pause=False):
        for c in chunks:
            if pause:
                await asyncio.sleep(0.01)  # the consumer catches up between chunks
            yield c

    def events(sse_texts):
        return [json.loads(e[len("data: "):]) for e in sse_texts]

    async def main():
        # Already queued when the consumer looks: one batch, in arrival order.
        got = [b async for b in batches([stream(chunk("a"), chunk("b"), chunk("c", finish="length"))])]
        assert [[c.choices[0].text for _, c in b] for b in got] == [["a", "b", "c"]]
        # Arriving one by one while the consumer waits: one batch each.
        got = [b async for b in batches([stream(chunk("a"), chunk("b"), pause=True)])]
        assert len(got) == 2

        fmt = CompletionFormat(Header("cmpl-1", "m"), n=1, logprobs=None)
        out = events([e async for e in fmt.stream(batches([
            stream(chunk("ab"), chunk("c", finish="length")),
            stream(chunk("x"), chunk("yz", finish="stop"))]), usage="last")])
        assert len(out) == 2  # one event for everything queued, then usage
        assert sorted((c["index"], c["text"], c["finish_reason"]) for c in out[0]["choices"]) == [
            (0, "abc", "length"), (1, "xyz", "stop")]
        assert out[1]["usage"]["completion_tokens"] == 6 and out[1]["usage"]["prompt_tokens"] == 6
        assert "usage" not in out[0]
        # continuous_usage_stats: every event carries the counts so far
        fmt = CompletionFormat(Header("cmpl-2", "m"), n=1, logprobs=None)
        out = events([e async for e in fmt.stream(batches([
            stream(chunk("ab"), chunk("c", finish="length"), pause=True)]), usage="every")])
        assert [e["usage"]["completion_tokens"] for e in out] == [2, 3, 3]

        chat = ChatFormat(Header("chat-1", "m"), n=2, top_logprobs=None)
        out = events([e async for e in chat.stream(batches([
            stream(chunk("he", 0), chunk("hi", 1), chunk("llo", 0, "stop"), chunk("!", 1, "stop"))]),
            usage="none")])
        assert len(out) == 2  # the role event, then one event for both choices
        assert {c["index"]: (c["delta"]["content"], c["finish_reason"]) for c in out[1]["choices"]} == {
            0: ("hello", "stop"), 1: ("hi!", "stop")}

    asyncio.run(main())


def test_engine_stream_error_after_a_batch_is_raised():
    from flagserve.entrypoints.openai.streams import batches

    async def broken():
        yield 1
        raise ValueError("engine failed")

    async def main():
        got = []
        with pytest.raises(ValueError, match="engine failed"):
            async for b in batches([broken()]):
                got.append(b)
        assert got == [[(0, 1)]]

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_handler():
    """A non-streamed request whose client disconnects: the handler is cancelled (its cleanup
    run: the ingress closes the engine streams, which aborts them), not left to finish."""
    from fastapi.responses import Response

    from flagserve.entrypoints.openai.api import unless_client_leaves

    async def main():
        cleaned, messages = [], asyncio.Queue()

        async def receive():
            return await messages.get()

        async def slow():
            try:
                await asyncio.sleep(60)
            finally:
                cleaned.append(True)

        async def quick():
            return Response("ok")

        task = asyncio.ensure_future(unless_client_leaves(receive, slow()))
        messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        await asyncio.sleep(0.05)
        assert not task.done()  # a message that is not a disconnect changes nothing
        messages.put_nowait({"type": "http.disconnect"})
        response = await asyncio.wait_for(task, 5)
        assert response.status_code == 499 and cleaned == [True]
        assert (await unless_client_leaves(receive, quick())).body == b"ok"

    asyncio.run(main())


def test_a_long_json_answer_lets_the_event_loop_in():
    """/tokenize of a huge text: the answer's encoding yields to other streams between slices,
    and the body is what JSONResponse would have sent."""
    from starlette.responses import JSONResponse

    from flagserve.entrypoints.openai.responses import JSON_SLICE, yielding_json

    payload = {"count": 3, "tokens": list(range(3 * JSON_SLICE + 5)),
               "token_strs": ["é\"x"] * (JSON_SLICE + 1), "none": None}
    turns = 0

    async def other_stream():
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    async def main():
        task = asyncio.create_task(other_stream())
        await asyncio.sleep(0)
        before = turns
        response = await yielding_json(payload)
        task.cancel()
        return response, turns - before

    response, others = asyncio.run(main())
    assert response.body == JSONResponse(payload).body
    assert response.media_type == "application/json"
    assert others >= 4 + 1  # one turn per slice of both long lists


def test_disaggregated_refusals_name_the_field():
    """n past the decode role's batch, before any prefill; a handoff refusal's field."""
    from flagserve.engine.kv_transfer.exports import check_handoff_params
    from flagserve.engine.sampling_params import SamplingParams
    from flagserve.entrypoints.openai.checks import check_n
    from flagserve.entrypoints.openai.engine_client import ModelInfo
    from flagserve.entrypoints.openai.errors import OpenAIError, request_error
    from flagserve.entrypoints.openai.protocol import CompletionRequest, parse_request

    info = ModelInfo("llm", "m", "/m", 512, 1000, max_n=4)
    check_n(parse_request(CompletionRequest, {"prompt": "hi", "n": 4}), info)
    with pytest.raises(OpenAIError) as err:
        check_n(parse_request(CompletionRequest, {"prompt": "hi", "n": 5}), info)
    assert (err.value.status, err.value.param) == (400, "n")
    with pytest.raises(ValueError) as refused:
        check_handoff_params(SamplingParams(prompt_logprobs=1))
    assert request_error(refused.value).param == "prompt_logprobs"
