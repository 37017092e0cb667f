"""The engine's handle on the grammar process (worker.py): start, send, receive, wait, stop.

A step's job goes through the shared memory, not the pipe: in the engine process every
syscall on the pipe cost 20-40 us (docs/performance.md, Structured outputs), and a step
made three. The pipe carries the rare messages: compile requests and their answers,
rejections, a Wake for a process that went to sleep, oversized jobs.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import subprocess
import sys
import tempfile
import time
import zlib
from multiprocessing.connection import Connection, Pipe
from typing import Any

from flagserve.engine.child_process import child_env
from flagserve.engine.structured_outputs.worker import (
    AREAS,
    ASLEEP,
    DONE,
    JOB_BYTES,
    JOB_CRC,
    JOB_LEN,
    MASK_CRC,
    SENT,
    SUBMITTED,
    UNREADABLE_S,
    WAITING,
    Done,
    Failed,
    Start,
    Step,
    Wake,
    header_slots,
    job_offset,
    job_rows,
    mask_crc,
    read_slot,
    shared_mask,
    shm_size,
    write_slot,
)

SPIN_S = 30e-6  # a job not done by then: the engine blocks until the grammar process says so
WAIT_S = 1e-3  # looking for a dead process meanwhile
STOP_TIMEOUT_S = 5.0


class GrammarProcessError(RuntimeError):
    pass


def _anonymous_file() -> int:
    """A file with no name to clean up: gone when both processes close it."""
    if hasattr(os, "memfd_create"):  # Linux
        return os.memfd_create("flagserve-grammar-mask")
    fd, path = tempfile.mkstemp(prefix="flagserve-grammar-mask-")
    os.unlink(path)
    return fd


class GrammarProcess:
    def __init__(self, start: Start):
        size = shm_size(start.max_rows, start.vocab_size)
        fd = _anonymous_file()
        parent, child = Pipe(duplex=True)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
            # One thread for torch, which xgrammar imports: the process borrows no more cores;
            # and none of the engine's OpenMP binding, which would pin it to the engine's first.
            env = {**child_env(), "OMP_NUM_THREADS": "1", "OMP_PROC_BIND": "false",
                   "TOKENIZERS_PARALLELISM": "false"}
            env.pop("OMP_PLACES", None)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flagserve.engine.structured_outputs.worker",
                 str(child.fileno()), str(fd)], pass_fds=(child.fileno(), fd), env=env)
        finally:
            os.close(fd)
            child.close()
        self.conn: Connection = parent
        self.slots = header_slots(self._mm)
        self.mask = shared_mask(self._mm, start.max_rows, start.vocab_size)
        self.check_mask = start.check_mask
        self._jobs = 0
        self._fills = [0] * AREAS  # rows the last job of each area fills
        self._received = 0  # messages read from the pipe, against the SENT slot
        self._inbox: list[Any] = []  # read while waiting for a job, for the next receive()
        self.error: str | None = None  # why the process is gone
        self.send(start)

    def send(self, msg: Any) -> None:
        if self.error is None:
            try:
                self.conn.send(msg)
            except OSError:
                self._gone()

    @property
    def last_job(self) -> int:
        return self._jobs

    def submit(self, step: Step) -> int:
        """Send a step's job; its number, for masks(). The caller has read the masks of the
        job before last, whose areas this one takes."""
        job = self._jobs = self._jobs + 1
        if job > AREAS:
            self._wait_done(job - AREAS)  # its job bytes were read (as a rule, long since)
        area = job % AREAS
        self._fills[area] = len(step.fill)
        data = pickle.dumps(step._replace(job=job), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > JOB_BYTES:
            self.send(step._replace(job=job))
            return job
        start = job_offset(job)
        self._mm[start:start + len(data)] = data
        write_slot(self.slots, JOB_LEN[area], len(data))
        write_slot(self.slots, JOB_CRC[area], zlib.crc32(data))
        write_slot(self.slots, SUBMITTED, job)  # last: the job is complete once this is seen
        if read_slot(self.slots, ASLEEP):
            self.send(Wake())
        return job

    def masks(self, job: int) -> Any:
        """The mask rows a job filled (in its Step.fill order), once written."""
        self.wait(job)
        return job_rows(self.mask, job, self._fills[job % AREAS])

    def wait(self, job: int) -> None:
        """Until the job is done: usually it is, since it ran beside the step. Late, the
        engine blocks on the pipe for the process's Done rather than spin: on a busy machine
        a spinning engine takes the core the grammar process needs. With the mask checked
        (Start.check_mask), also until its rows match their crc."""
        self._wait_done(job)
        if self.check_mask and self._fills[job % AREAS]:
            self._wait_mask(job, self._fills[job % AREAS])

    def _wait_mask(self, job: int, rows: int) -> None:
        """DONE was seen; on a weakly ordered CPU the rows may not all be visible yet."""
        deadline = time.perf_counter() + UNREADABLE_S
        while mask_crc(self.mask, job, rows) != read_slot(self.slots, MASK_CRC[job % AREAS]):
            if time.perf_counter() > deadline:
                self.error = f"the mask of job {job} stayed unreadable (its checksum differs)"
                raise GrammarProcessError(self.error)

    def _wait_done(self, job: int) -> None:
        start = time.perf_counter()
        while read_slot(self.slots, DONE) < job:
            if time.perf_counter() - start < SPIN_S:
                continue
            write_slot(self.slots, WAITING, job)  # then looked at again: no Done is missed
            self.send(Wake())  # in case it went to sleep just as the job came
            try:
                while read_slot(self.slots, DONE) < job:
                    if self.error is not None or self.proc.poll() is not None:
                        self._read(0.0)  # its Failed message, if it sent one
                        self._gone()
                        raise GrammarProcessError(self.error)
                    self._read(WAIT_S)
            finally:
                write_slot(self.slots, WAITING, 0)

    def receive(self, timeout: float = 0.0, force: bool = False) -> list[Any]:
        """The messages that came (waiting up to `timeout` for the first). Without a timeout
        the pipe is read only when the process says it sent something."""
        if timeout or force or read_slot(self.slots, SENT) > self._received:
            self._read(timeout)
        out, self._inbox = self._inbox, []
        return out

    def _read(self, timeout: float) -> None:
        try:
            while self.error is None and self.conn.poll(timeout):
                msg = self.conn.recv()
                self._received += 1
                if isinstance(msg, Failed):
                    self.error = f"the grammar process failed:\n{msg.error}"
                elif not isinstance(msg, Done):
                    self._inbox.append(msg)
                timeout = 0.0
        except (EOFError, OSError):
            self._gone()

    def _gone(self) -> None:
        if self.error is None:
            code = self.proc.poll()
            self.error = f"the grammar process exited (code {code})" if code is not None else \
                "the grammar process stopped answering"

    def close(self) -> None:
        if self.error is None:
            self.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        if self.proc.poll() is None:  # after an error it may not read the pipe: not waited for
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.error = self.error or "the grammar process was stopped"
