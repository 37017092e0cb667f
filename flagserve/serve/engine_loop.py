"""AsyncEngine: LLMEngine.step() on one dedicated thread, a stream per request for asyncio.

The engine is not thread-safe, so every call into it (add_request, abort, step, get_stats)
happens on the step thread; the event loop only enqueues commands and reads per-request
queues. One step serves every request in the continuous batch; its outputs reach the event
loop in one call_soon_threadsafe. Outputs are DELTA outputs; a consumer that falls behind
gets the queued deltas merged into one, so a slow client never slows the batch.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from flagserve.engine.outputs import CompletionOutput, RequestOutput
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop raised; the replica must be restarted (its health check fails)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: Any, on_step: Callable[[list[RequestOutput], float], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the step thread with each step's outputs (metrics)
        self.stats = engine.get_stats()  # refreshed by the step thread; read by metrics
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    # event-loop side

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield merged DELTA outputs of one request until it finishes; aborts it if closed early."""
        if not self.alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        self._loop = self._loop or asyncio.get_running_loop()
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(request_id, prompt, params, arrival_time or time.time(), done))
        added = finished = False
        try:
            await asyncio.wrap_future(done)  # add_request's ValueError surfaces here
            added = True
            while not finished:
                out = _merge(await stream.get(), stream)
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if added and not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _dispatch(self, outputs: list[RequestOutput] | BaseException) -> None:
        if isinstance(outputs, BaseException):
            for stream in self._streams.values():
                stream.put_nowait(outputs)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    # step-thread side

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self.stats = self.engine.get_stats()
                if self.on_step is not None:
                    self.on_step(outputs, time.time())
                if outputs and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as err:  # noqa: BLE001 - any failure ends the replica
            log.exception("engine step loop failed")
            self.error = err
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, EngineDeadError(repr(err)))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        command.arrival_time)
            except Exception as err:  # noqa: BLE001 - handed to the caller
                command.done.set_exception(err)
            else:
                command.done.set_result(None)
        self.stats = self.engine.get_stats()


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


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in a.outputs}
    outs: list[CompletionOutput] = []
    for c in b.outputs:
        prev = by_index.pop(c.index, None)
        if prev is None:
            outs.append(c)
            continue
        logprobs = None
        if prev.logprobs is not None or c.logprobs is not None:
            logprobs = (prev.logprobs or []) + (c.logprobs or [])
        outs.append(CompletionOutput(c.index, prev.text + c.text, prev.token_ids + c.token_ids,
                                     c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason))
    outs.extend(by_index.values())
    outs.sort(key=lambda c: c.index)
    return replace(b, outputs=outs)
