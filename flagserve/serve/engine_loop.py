"""The engine's step loop, and the asyncio side that streams its outputs per request.

    run_steps    LLMEngine.step() in a loop that applies commands (add, abort) between steps
                 and publishes one StepResult per step: the new tokens of every request in the
                 batch, the engine's stats, the add_request errors. It runs on a thread of the
                 replica (EngineThread, here) or in a process of its own (engine_core.py).
    AsyncEngine  the event loop's side: a stream per request, fed by the StepResults.

The engine is not thread-safe: only the step loop calls into it. Outputs are DELTA outputs;
a consumer that falls behind gets its queued deltas merged into one, so a slow client never
slows the batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from flagserve.engine.outputs import CompletionOutput, RequestOutput
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams
from flagserve.engine.stats import EngineStats

log = logging.getLogger(__name__)
IDLE_WAIT_S = 1.0  # how long an idle step loop sleeps between checks for shutdown


class EngineDeadError(RuntimeError):
    """The step loop stopped; the replica must be restarted (its health check fails)."""


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class AbortRequest:
    request_id: str


Command = AddRequest | AbortRequest


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    stats: EngineStats
    time: float
    rejected: list[tuple[str, Exception]] = field(default_factory=list)  # add_request errors


def run_steps(engine: Any, receive: Callable[[float], list[Command]],
              publish: Callable[[StepResult], None], stopping: Callable[[], bool]) -> None:
    """Step `engine` until `stopping()`. receive(timeout) returns the commands that arrived,
    waiting up to `timeout` seconds for one (0 while requests are running)."""
    while not stopping():
        commands = receive(0.0 if engine.has_unfinished() else IDLE_WAIT_S)
        rejected = apply_commands(engine, commands)
        outputs = engine.step() if engine.has_unfinished() else []
        if outputs or commands:
            publish(StepResult(outputs, engine.get_stats(), time.time(), rejected))


def apply_commands(engine: Any, commands: list[Command]) -> list[tuple[str, Exception]]:
    rejected = []
    for command in commands:
        if isinstance(command, AbortRequest):
            engine.abort(command.request_id)
            continue
        try:
            engine.add_request(command.request_id, command.prompt, command.params,
                               command.arrival_time)
        except Exception as err:  # noqa: BLE001 - handed to the caller of generate()
            rejected.append((command.request_id, err))
    return rejected


class EngineCore(Protocol):
    """Where run_steps runs: a thread of this process, or a child process."""
    max_model_len: int
    vocab_size: int
    stats: EngineStats  # as of construction

    def start(self, on_result: Callable[[StepResult | EngineDeadError], None]) -> None:
        """Start stepping; on_result is called (on another thread) with every StepResult,
        and once with an EngineDeadError if the loop dies."""

    def send(self, command: Command) -> None: ...

    @property
    def alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class EngineThread:
    """run_steps on a thread of this process (the engine lives here)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.stats = engine.get_stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, on_result: Callable[[StepResult | EngineDeadError], None]) -> None:
        def loop() -> None:
            try:
                run_steps(self.engine, self._receive, on_result, lambda: self._stopping)
            except BaseException as err:  # noqa: BLE001 - any failure ends the replica
                log.exception("engine step loop failed")
                on_result(EngineDeadError(repr(err)))

        self._thread = threading.Thread(target=loop, name="engine-step", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float) -> list[Command]:
        commands = []
        try:
            commands.append(self._commands.get(timeout=timeout) if timeout
                            else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def send(self, command: Command) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.shutdown()  # the shard workers and their placement group


class AsyncEngine:
    def __init__(self, core: EngineCore,
                 on_step: Callable[[list[RequestOutput], float], None] | None = None):
        self.core = core
        self.on_step = on_step  # called with each step's outputs (metrics), off the event loop
        self.stats = core.stats  # refreshed with every StepResult; read by metrics
        self.error: EngineDeadError | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        core.start(self._on_result)

    @property
    def alive(self) -> bool:
        return self.error is None and self.core.alive

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield merged DELTA outputs of one request until it finishes; aborts it if closed early.
        add_request's errors (ValueError for a bad request) are raised by the first step."""
        if not self.alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        self._loop = asyncio.get_running_loop()
        params = replace(params, output_kind=RequestOutputKind.DELTA)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            self.core.send(AddRequest(request_id, prompt, params, arrival_time or time.time()))
            while not finished:
                out = _merge(await stream.get(), stream)
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
                self.on_step(result.outputs, result.time)
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
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)


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
