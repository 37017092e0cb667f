"""The step loop on a thread of this process (engine_core: thread; the engine lives here)."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from flagserve.engine.core.loop import Command, EngineDeadError, StepResult, run_steps

log = logging.getLogger(__name__)


class EngineThread:
    """run_steps on a thread of this process (the engine lives here)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.prompt_vocab_size
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

    @property
    def accepting(self) -> bool:
        return self.alive and not self._stopping

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.shutdown()  # the shard workers and their placement group
