"""The event loop's side of an EngineCore: one stream of DELTA outputs per request.

A consumer that falls behind gets its queued deltas merged into one, so a slow client never
slows the batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from flagserve.engine.core.interface import EngineCore
from flagserve.engine.core.loop import (
    AbortRequest,
    AddRequest,
    Command,
    EngineDeadError,
    ImportRequest,
    PrefillRequest,
    StepResult,
)
from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.engine.outputs import RequestOutput, merge_deltas
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams


class AsyncEngine:
    def __init__(self, core: EngineCore,
                 on_step: Callable[[StepResult], None] | None = None):
        self.core = core
        self.on_step = on_step  # called with each step's result (metrics), off the event loop
        self.stats = core.stats  # refreshed with every StepResult; read by metrics
        self.error: EngineDeadError | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        core.start(self._on_result)

    @property
    def alive(self) -> bool:
        return self.error is None and self.core.alive

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Yield merged DELTA outputs of one request until it finishes; aborts it if closed early.
        add_request's errors (ValueError for a bad request) are raised by the first step."""
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        async for out in self._stream(request_id, AddRequest(request_id, prompt, params,
                                                             arrival_time or time.time(), priority)):
            yield out

    async def prefill(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      arrival_time: float | None = None, priority: int = 0
                      ) -> AsyncIterator[RequestOutput | RequestHandoff]:
        """generate() on a prefill engine: yields the request's RequestHandoff after its first
        token and ends (the request has left this engine; abort() withdraws its KV until a
        decode engine has fetched it), or its outputs if every sequence ended with that token."""
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        async for out in self._stream(request_id, PrefillRequest(request_id, prompt, params,
                                                                 arrival_time or time.time(),
                                                                 priority)):
            yield out

    async def import_request(self, handoff: RequestHandoff) -> AsyncIterator[RequestOutput]:
        """generate() on a decode engine, continuing a prefill engine's request; the first
        output carries the first token."""
        async for out in self._stream(handoff.request_id, ImportRequest(handoff)):
            yield out

    async def _stream(self, request_id: str, command: Command
                      ) -> AsyncIterator[RequestOutput | RequestHandoff]:
        if self.error is not None or not self.core.accepting:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        self._loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            self.core.send(command)
            while not finished:
                item = await stream.get()
                if isinstance(item, RequestHandoff):
                    finished = True  # it has left this engine: nothing to abort here
                    yield item
                    return
                out = _merge(item, stream)
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # also when add_request failed: aborting an unknown id is a no-op
                with contextlib.suppress(EngineDeadError):  # nothing left to abort
                    self.core.send(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        self.core.send(AbortRequest(request_id))

    def shutdown(self) -> None:
        self.core.shutdown()

    def _on_result(self, result: StepResult | EngineDeadError) -> None:
        """On the step thread (or the engine process's reader thread)."""
        if isinstance(result, EngineDeadError):
            self.error = result
        else:
            self.stats = result.stats
            if self.on_step is not None:
                self.on_step(result)
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(self._dispatch, result)

    def _dispatch(self, result: StepResult | EngineDeadError) -> None:
        if isinstance(result, EngineDeadError):
            for stream in self._streams.values():
                stream.put_nowait(result)
            return
        for request_id, err in result.rejected:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(err)
        for item in (*result.outputs, *result.handoffs):
            stream = self._streams.get(item.request_id)
            if stream is not None:
                stream.put_nowait(item)


def _merge(first: RequestOutput | BaseException, stream: asyncio.Queue) -> RequestOutput:
    """Merge `first` with every delta already queued behind it."""
    if isinstance(first, BaseException):
        raise first
    merged = first
    while not stream.empty():
        nxt = stream.get_nowait()
        if isinstance(nxt, BaseException):
            raise nxt
        merged = merge_deltas(merged, nxt)
    return merged
