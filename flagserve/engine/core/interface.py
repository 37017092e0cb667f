"""The EngineCore interface: where the step loop runs, chosen once per replica."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

from flagserve.engine.core.loop import Command, EngineDeadError, StepResult
from flagserve.engine.stats import EngineStats

CoreMode = Literal["process", "thread"]  # serve.<id>.engine_core, once `auto` is resolved


class EngineCore(Protocol):
    """Where run_steps runs: a thread of this process, or a child process."""
    max_model_len: int
    vocab_size: int  # token ids a request may name: LLMEngine.prompt_vocab_size
    stats: EngineStats  # as of construction

    def start(self, on_result: Callable[[StepResult | EngineDeadError], None]) -> None:
        """Start stepping; on_result is called (on another thread) with every StepResult,
        and once with an EngineDeadError if the loop dies."""

    def send(self, command: Command) -> None: ...

    @property
    def alive(self) -> bool:
        """Alive now, exact (what /health reports; may read the OS's process tables)."""

    @property
    def accepting(self) -> bool:
        """Not known dead or stopping: cheap enough for every request. A request admitted
        in the moment between a death and its report gets the EngineDeadError that the
        report sends every stream (start's on_result), not a hang."""

    def shutdown(self) -> None: ...


def make_core(engine_args: Any, where: CoreMode, meanwhile: Callable[[], None] = lambda: None
              ) -> EngineCore:
    """The step loop in a child process (`process`) or on a thread of this one (`thread`).

    `meanwhile` is this process's own start-up (imports, tokenizers): it runs while a child
    loads the model, seconds saved on a small machine; before the engine on a thread."""
    if where == "process":
        from flagserve.engine.core.process import EngineProcess
        return EngineProcess(engine_args, meanwhile)
    meanwhile()
    from flagserve.engine.core.thread import EngineThread
    from flagserve.engine.llm_engine import LLMEngine  # heavy: torch, the model
    return EngineThread(LLMEngine(engine_args))
