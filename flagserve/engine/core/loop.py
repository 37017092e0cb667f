"""The step loop: LLMEngine.step() in a loop that applies commands (add, abort; prefill and
import for disaggregation) between steps and publishes one StepResult per step: the new
tokens of every request in the batch, the engine's stats, the add_request errors, the
requests a prefill engine handed off. The engine is not thread-safe: only this loop calls
into it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagserve.engine.kv_transfer.handoff import RequestHandoff
from flagserve.engine.outputs import RequestOutput
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.stats import EngineStats

IDLE_WAIT_S = 1.0  # how long an idle step loop sleeps between checks for shutdown


class EngineDeadError(RuntimeError):
    """The step loop stopped; the replica must be restarted (its health check fails)."""


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass
class PrefillRequest(AddRequest):
    """add_prefill_request: run the prompt, then hand the request off (StepResult.handoffs)."""


@dataclass
class ImportRequest:
    """import_request: continue a prefill engine's request from its handoff."""
    handoff: RequestHandoff


@dataclass
class AbortRequest:
    request_id: str


Command = AddRequest | ImportRequest | AbortRequest


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    stats: EngineStats
    time: float
    rejected: list[tuple[str, Exception]] = field(default_factory=list)  # add_request errors
    handoffs: list[RequestHandoff] = field(default_factory=list)  # for decode engines
    aborted: list[str] = field(default_factory=list)  # requests this engine withdrew (metrics)


def run_steps(engine: Any, receive: Callable[[float], list[Command]],
              publish: Callable[[StepResult], None], stopping: Callable[[], bool]) -> None:
    """Step `engine` until `stopping()`. receive(timeout) returns the commands that arrived,
    waiting up to `timeout` seconds for one (0 while requests are running)."""
    while not stopping():
        busy = engine.has_unfinished()
        commands = receive(0.0 if busy else IDLE_WAIT_S)
        rejected, aborted = apply_commands(engine, commands)
        outputs = engine.step() if engine.has_unfinished() else []
        handoffs = engine.take_handoffs()
        # a step with no outputs can still change the stats (a KV transfer finished and freed
        # its blocks): the step that leaves the engine idle publishes them, or they stay stale
        went_idle = busy and not engine.has_unfinished()
        if outputs or commands or handoffs or went_idle:
            publish(StepResult(outputs, engine.get_stats(), time.time(), rejected, handoffs,
                               aborted))


def apply_commands(engine: Any, commands: list[Command]
                   ) -> tuple[list[tuple[str, Exception]], list[str]]:
    """(add_request's errors, the requests aborted): an abort is reported with the step that
    applied it, after every output of its request."""
    rejected, aborted = [], []
    for command in commands:
        if isinstance(command, AbortRequest):
            if engine.abort(command.request_id):
                aborted.append(command.request_id)
            continue
        try:
            if isinstance(command, ImportRequest):
                engine.import_request(command.handoff)
                continue
            add = engine.add_prefill_request if isinstance(command, PrefillRequest) else engine.add_request
            add(command.request_id, command.prompt, command.params, command.arrival_time,
                command.priority)
        except Exception as err:  # noqa: BLE001 - handed to the caller of generate()
            request_id = command.handoff.request_id if isinstance(command, ImportRequest) \
                else command.request_id
            rejected.append((request_id, err))
    return rejected, aborted
