"""The step loop: LLMEngine.step() in a loop that applies commands (add, abort) between
steps and publishes one StepResult per step: the new tokens of every request in the batch,
the engine's stats, the add_request errors. The engine is not thread-safe: only this loop
calls into it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
