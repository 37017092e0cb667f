"""EngineProcess: the step loop in a child process of its replica (why: __init__.py).

    replica  EngineProcess: spawns `python -m flagserve.engine.core.process FD`; a writer
             thread sends the commands (AddRequest, AbortRequest, Shutdown) and a reader
             thread hands the StepResults to the event loop
    child    main(): builds LLMEngine, answers CoreReady (or CoreFailed), then run_steps

Messages are pickled over a socketpair (multiprocessing.connection framing); the per-step
results as plain tuples (wire.py). The child exits when its replica goes away: a closed
socket ends the loop at the next step.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from flagserve.engine.child_process import child_env
from flagserve.engine.core import wire
from flagserve.engine.core.loop import AbortRequest, Command, EngineDeadError, StepResult, run_steps
from flagserve.engine.cpu_runtime import (
    apply_thread_plan,
    cpu_process_env,
    engine_thread_plan,
)
from flagserve.engine.stats import EngineStats

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


@dataclass
class CoreReady:
    max_model_len: int
    vocab_size: int
    stats: EngineStats


@dataclass
class CoreFailed:
    error: str  # the child's traceback


@dataclass
class Shutdown:
    pass


class EngineProcess:
    """run_steps in a child process; an EngineCore (interface.py)."""

    def __init__(self, engine_args: Any, meanwhile: Callable[[], None] = lambda: None):
        parent, child = Pipe(duplex=True)
        env = child_env()
        env.update(engine_thread_plan(env).env(env))  # OpenMP reads its settings once, at load
        if _on_cpu(engine_args):
            env.update(cpu_process_env(env))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flagserve.engine.core.process", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env)
        child.close()
        self.conn: Connection = parent
        self._stopping = False
        self.error: EngineDeadError | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # pickled; None ends the writer
        self._decoder = wire.Decoder()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        try:
            self.conn.send(engine_args)
            meanwhile()  # make_core's docstring
            ready = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.max_model_len, self.vocab_size, self.stats = (ready.max_model_len, ready.vocab_size,
                                                           ready.stats)

    def _wait_ready(self) -> CoreReady:
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self.proc.returncode} "
                                   "while loading the model; its output is in this replica's log")
        try:
            msg = _recv(self.conn)
        except EOFError:
            raise RuntimeError(f"the engine process exited with code {self.proc.wait()} "
                               "while loading the model") from None
        if isinstance(msg, CoreFailed):
            raise RuntimeError(f"the engine process failed to start:\n{msg.error}")
        return msg

    def start(self, on_result: Callable[[StepResult | EngineDeadError], None]) -> None:
        """Two threads, so that the event loop never blocks on the socket: one reads the
        StepResults, one writes the commands queued by send()."""
        def read() -> None:
            try:
                while True:
                    msg = _recv(self.conn)
                    if isinstance(msg, CoreFailed):
                        raise EngineDeadError(f"the engine process failed:\n{msg.error}")
                    on_result(self._decoder.decode(msg))
            except (EOFError, OSError):
                if not self._stopping:
                    self._dead(on_result, EngineDeadError(
                        f"the engine process exited with code {self.proc.wait()}"))
            except EngineDeadError as err:
                self._dead(on_result, err)
            except BaseException as err:  # noqa: BLE001 - a reader that stops must not hang the child
                log.exception("reading the engine process's results failed")
                self._dead(on_result, EngineDeadError(repr(err)))

        def write() -> None:
            while (data := self._outbox.get()) is not None:
                try:
                    self.conn.send_bytes(data)
                except OSError:
                    return  # the child is gone; the reader reports how

        self._reader = threading.Thread(target=read, name="engine-core-reader", daemon=True)
        self._writer = threading.Thread(target=write, name="engine-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _dead(self, on_result: Callable[[EngineDeadError], None], err: EngineDeadError) -> None:
        self.error = err
        if self.proc.poll() is None:
            self._kill()
        on_result(err)

    def send(self, command: Command | Shutdown) -> None:
        if self.error is not None:
            raise self.error
        if isinstance(command, AbortRequest):
            self._decoder.forget(command.request_id)
        # Pickled here, where a request that cannot be (nested past the recursion limit) fails
        # alone: in the writer thread it ended the thread, and every later request waited.
        try:
            data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - RecursionError, PicklingError, TypeError, ...
            raise ValueError(f"the request cannot be sent to the engine process: {err}") from None
        self._outbox.put(data)

    @property
    def alive(self) -> bool:
        """Alive now (what /health reports): not failed, not exited and not exiting. The
        reader thread learns of a death only when the child's socket closes, late in its
        exit, and Popen.poll() says nothing while that thread waits for the exit."""
        return self.error is None and _running(self.proc.pid) and self.proc.returncode is None

    @property
    def accepting(self) -> bool:
        # alive's procfs reads took ~10% of a busy replica's event loop (one per request)
        return self.error is None and not self._stopping and not _exited(self.proc.pid)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._writer is None:  # never started: no writer drains the outbox (10 s lost)
            with contextlib.suppress(OSError):
                self.conn.send(Shutdown())
        else:
            self._outbox.put(pickle.dumps(Shutdown(), protocol=pickle.HIGHEST_PROTOCOL))
            self._outbox.put(None)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
        if self._writer is not None:
            self._writer.join(timeout=STOP_TIMEOUT_S)
        self.conn.close()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _on_cpu(engine_args: Any) -> bool:
    device = str(getattr(engine_args, "device", "auto"))
    if device == "auto":
        import torch
        return not torch.cuda.is_available()
    return device == "cpu"


PF_EXITING = 0x4  # Linux task flag: the process has started to exit
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # its bit in /proc/<pid>/status SigPnd, ShdPnd


def _exited(pid: int) -> bool:
    """The child has exited (waitid without reaping it: the reader thread's wait() does that)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped already


def _running(pid: int) -> bool:
    """The child has not exited, is not exiting, and has no SIGKILL pending (procfs, where
    there is one: from the kill() on, not from when the child is next scheduled)."""
    if _exited(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no procfs: the exit is seen once it is complete
    if int(stat.rsplit(b")", 1)[1].split()[6]) & PF_EXITING:  # field 9, flags
        return False
    pending = re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, re.M)
    return not any(int(mask, 16) & SIGKILL_PENDING for mask in pending)


def _send(conn: Connection, msg: CoreReady | CoreFailed) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    """What the child sent: CoreReady, CoreFailed, or a step result in wire.py's tuples."""
    return pickle.loads(conn.recv_bytes())


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    engine = _start(conn)
    if engine is None:
        return 1
    encoder = wire.Encoder()
    inbox = _Inbox(conn, encoder)
    try:
        run_steps(engine, inbox.receive, lambda result: conn.send_bytes(encoder.encode(result)),
                  lambda: inbox.stopping)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the replica went away while a result was being sent
    except BaseException:  # noqa: BLE001 - the replica's health check fails on it
        log.exception("engine step loop failed")
        with contextlib.suppress(OSError):  # the replica is gone: nobody to tell
            _send(conn, CoreFailed(traceback.format_exc()))
        return 1
    finally:
        engine.shutdown()
    return 0


def _start(conn: Connection) -> Any:
    """The engine, from the EngineArgs the replica sends, and CoreReady sent back; None when
    it could not start (CoreFailed sent: the replica fails to start)."""
    try:
        plan = engine_thread_plan()
        apply_thread_plan(plan)
        log.info("torch threads: %d, bound to cores %s", plan.num_threads,
                 ",".join(map(str, plan.cpus)) or "none")
        from flagserve.engine.llm_engine import LLMEngine
        from flagserve.engine.structured_outputs.params import import_grammar_library
        engine = LLMEngine(conn.recv())
        import_grammar_library()
    except BaseException:  # noqa: BLE001 - reported to the replica, which fails to start
        _send(conn, CoreFailed(traceback.format_exc()))
        return None
    _send(conn, CoreReady(engine.max_model_len, engine.prompt_vocab_size, engine.get_stats()))
    return engine


class _Inbox:
    """The replica's commands for the step loop; `stopping` once it asks to stop or is gone."""

    def __init__(self, conn: Connection, encoder: wire.Encoder):
        self.conn, self.encoder, self.stopping = conn, encoder, False
        # One poll object for the life of the loop: Connection.poll builds a selector per
        # call, and this runs every step.
        self.poller = select.poll()
        self.poller.register(conn.fileno(), select.POLLIN)

    def receive(self, timeout: float) -> list[Command]:
        """What has come, waiting up to `timeout` s for the first command."""
        commands: list[Command] = []
        try:
            while self.poller.poll(0 if commands else timeout * 1000):
                msg = self.conn.recv()
                if isinstance(msg, Shutdown):
                    self.stopping = True
                    break
                commands.append(msg)
                if isinstance(msg, AbortRequest):
                    self.encoder.forget(msg.request_id)
        except (EOFError, OSError):  # the replica is gone
            self.stopping = True
        return commands


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: what it sends must unpickle as
    # flagserve.engine.core.process.CoreReady etc. in the replica.
    from flagserve.engine.core.process import main as module_main
    sys.exit(module_main(sys.argv[1:]))
