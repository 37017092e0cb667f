"""The grammar process: xgrammar's matchers and compiler, beside the engine's step loop.

Filling a step's token bitmask costs about as much as a small model's forward (5-10 us per
row), and must not run on the engine's thread: in a thread of the engine process it still
cost the step most of its time, since each of its hand-overs of the GIL makes the step wait
for a woken thread (docs/performance.md, Structured outputs). So the matchers live here. The
engine writes each step's job (matcher changes, the tokens to accept, the rows to fill)
into shared memory and reads the mask there once the counter in the header says the job
is done; while jobs come, this process looks for them between short sleeps, so the engine
never pays for waking it (each syscall on the pipe cost the engine 20-40 us).

Jobs alternate between two areas, each a job's bytes and the mask rows it fills, so that the
engine can send a job while the one before is being filled: the job that accepts a step's new
tokens and fills the next step's masks leaves as soon as the tokens are known (matchers.py),
and the next step's own job, for rows it did not cover, need not wait for it.

    python -m flagserve.engine.structured_outputs.worker PIPE_FD SHM_FD
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import pickle
import select
import sys
import threading
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

# The shared memory: a header of int64 slots, the AREAS job areas, then AREAS x max_rows mask
# rows; job j uses job area j % AREAS and mask rows from (j % AREAS) * max_rows.
# Header slots. The engine writes SUBMITTED, WAITING (the job it blocks on) and per job area
# JOB_LEN and JOB_CRC (of the job's bytes); this process DONE (the last job finished), SENT
# (messages sent), ASLEEP and per mask area MASK_CRC (of its rows, where Start.check_mask).
AREAS = 2
DONE, SUBMITTED, SENT, ASLEEP, WAITING = range(5)
JOB_LEN, JOB_CRC, MASK_CRC = (5, 6), (7, 8), (9, 10)  # indexed by area
HEADER = 128
JOB_BYTES = 1 << 20  # a pickled Step; a larger one (long replays) goes over the pipe
# While jobs come, the pipe and the job area are looked at POLLS_PER_STEP times per interval
# between jobs: often enough that a job starts early in the forward it runs beside, rarely
# enough not to keep taking a core from the engine's threads (at a fixed 50 us, a SmolLM2
# step with 2 threads took 12% longer; 4 looks per step cost the served tiny model less CPU
# than 16 or 8 for the same ITL). Steps long enough for looks MAX_POLL_S apart wake this
# process instead.
POLL_S = 50e-6  # the shortest sleep between looks
MAX_POLL_S = 1e-3
POLLS_PER_STEP = 4
ACTIVE_S = 0.5  # then block on the pipe: an idle server costs nothing
UNREADABLE_S = 1.0  # a job's bytes (or its mask) not all visible after its number: an error after this

log = logging.getLogger(__name__)


class Start(NamedTuple):
    tokenizer: str  # what load_tokenizer() takes
    vocab_size: int
    stop_token_ids: list[int]
    max_rows: int
    check_mask: bool = False  # write MASK_CRC before DONE (see weakly_ordered())


class Compile(NamedTuple):
    hold_id: int
    kind: str
    spec: str


class Step(NamedTuple):
    job: int  # the header's counter reads this once the mask is written
    # In order: ("new", seq_id, hold_id), ("unhold", hold_id) (its matchers are made, or the
    # request went away), ("forget", seq_id), ("reset", seq_id, output tokens)
    ops: list[tuple]
    accept: tuple[list[int], list[int]]  # seq ids and one token each
    fill: list[int]  # seq ids, one mask row each: the job's rows (job_rows) in this order


class Wake(NamedTuple):  # a job is in the shared memory (sent when the process sleeps)
    pass


class Done(NamedTuple):  # the job the engine is blocked on is finished
    job: int


class Compiled(NamedTuple):
    hold_id: int
    error: str | None
    requests: int  # the compiler's counters, cumulative
    cache_hits: int


class Rejected(NamedTuple):  # a token outside its grammar (a bug): the matcher stays before it
    seq_ids: list[int]


class Failed(NamedTuple):
    error: str  # traceback


def shm_size(max_rows: int, vocab_size: int) -> int:
    return HEADER + AREAS * (JOB_BYTES + max_rows * ((vocab_size + 31) // 32) * 4)


def job_offset(job: int) -> int:
    """Where job `job`'s bytes go in the shared memory."""
    return HEADER + job % AREAS * JOB_BYTES


def shared_mask(mm: mmap.mmap, max_rows: int, vocab_size: int) -> Any:
    """The [AREAS * max_rows, ceil(vocab / 32)] int32 mask rows in the shared memory."""
    import torch
    words = (vocab_size + 31) // 32
    return torch.frombuffer(mm, dtype=torch.int32, offset=HEADER + AREAS * JOB_BYTES,
                            count=AREAS * max_rows * words).view(AREAS * max_rows, words)


def first_row(mask: Any, job: int) -> int:
    """The first of job `job`'s mask rows (its area's)."""
    return job % AREAS * (mask.shape[0] // AREAS)


def job_rows(mask: Any, job: int, count: int) -> Any:
    """The `count` mask rows that job `job` fills, in its Step.fill order."""
    first = first_row(mask, job)
    return mask[first:first + count]


def mask_crc(mask: Any, job: int, count: int) -> int:
    """The checksum of job `job`'s `count` mask rows (read in place), seeded with the job's
    number: a stale checksum read beside stale rows (both an older job's) must not pass for
    this job's."""
    return zlib.crc32(job_rows(mask, job, count).numpy(), job & 0xFFFFFFFF)


def weakly_ordered() -> bool:
    """Whether another core may see this one's stores out of order: everything but x86.
    There the mask's rows get a checksum too (Start.check_mask), so that the engine never
    reads a row older than the DONE it saw; x86 needs none and pays nothing."""
    import platform
    return platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")


def header_slots(mm: mmap.mmap) -> memoryview:
    """The header's int64 slots, each read and written whole: a native "q" item is one
    aligned 8-byte load or store. (struct's "<q" goes byte by byte: the grammar process read
    torn job counters, took a job twice and accepted its tokens twice.)"""
    return memoryview(mm)[:HEADER].cast("q")


def read_slot(slots: memoryview, slot: int) -> int:
    return slots[slot]


def write_slot(slots: memoryview, slot: int, value: int) -> None:
    slots[slot] = value


class Worker:
    def __init__(self, conn: Connection, mm: mmap.mmap, start: Start):
        import xgrammar as xgr

        from flagserve.engine.structured_outputs.compiler import GrammarCompiler
        from flagserve.models.tokenizer import load_tokenizer
        self.conn, self.mm, self._xgr = conn, mm, xgr
        self.slots = header_slots(mm)
        self._send_lock = threading.Lock()  # compile callbacks send from the compiler's threads
        self._sent = 0
        self.seen = 0  # the last job taken from the shared memory
        self.unreadable_since: float | None = None  # when the next job was first seen unreadable
        self.compiler = GrammarCompiler(load_tokenizer(start.tokenizer), start.vocab_size,
                                        start.stop_token_ids)
        self.mask = shared_mask(mm, start.max_rows, start.vocab_size)
        self.check_mask = start.check_mask
        self.holds: dict[int, Any] = {}  # hold id -> Future of its CompiledGrammar
        self.matchers: dict[int, Any] = {}  # seq id -> xgrammar.GrammarMatcher
        # One thread: more competed with the engine's own for 2 cores (a 6x slower fill).
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def send(self, msg: Any) -> None:
        """To the engine, which looks at the pipe only when the SENT count says to. An engine
        that is gone (a compile finishing after it exited) is serve()'s to notice: its next
        read of the pipe ends this process, without a traceback from a compiler thread."""
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, ConnectionResetError):
                return
            self._sent += 1
            write_slot(self.slots, SENT, self._sent)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Step):
            self.step(msg)
        elif isinstance(msg, Compile):
            future = self.compiler.submit(msg.kind, msg.spec)
            self.holds[msg.hold_id] = future
            future.add_done_callback(lambda f, hold_id=msg.hold_id: self._compiled(hold_id, f))

    def _compiled(self, hold_id: int, future: Any) -> None:
        err = future.exception()
        if err is not None:
            self.holds.pop(hold_id, None)
        self.send(Compiled(hold_id, None if err is None else f"{type(err).__name__}: {err}",
                           self.compiler.requests, self.compiler.cache_hits))

    def step(self, job: Step) -> None:
        self.seen, self.unreadable_since = job.job, None  # (a job over the pipe skips take_job)
        rejected = [seq_id for op in job.ops if (seq_id := self._apply(op)) is not None]
        ids, tokens = job.accept
        if ids:
            ok = self.batch.batch_accept_token([self.matchers[i] for i in ids], tokens)
            rejected += [i for i, accepted in zip(ids, ok) if not accepted]
        if job.fill:
            first = first_row(self.mask, job.job)
            self.batch.batch_fill_next_token_bitmask([self.matchers[i] for i in job.fill], self.mask,
                                                     list(range(first, first + len(job.fill))))
        if rejected:
            self.send(Rejected(rejected))  # before the counter: the engine reads it after
        if self.check_mask:
            write_slot(self.slots, MASK_CRC[job.job % AREAS], mask_crc(self.mask, job.job, len(job.fill)))
        write_slot(self.slots, DONE, job.job)
        if read_slot(self.slots, WAITING) == job.job:
            self.send(Done(job.job))

    def take_job(self) -> Step | None:
        """The job the engine wrote into the shared memory, if there is a new one.

        The engine writes the job's bytes, then its number. x86 keeps stores in that order,
        but a weakly ordered CPU (Arm: Grace, Graviton) may show the number before all the
        bytes: a job whose checksum or number does not match is looked at again later, and
        only one that stays unreadable for UNREADABLE_S is an error (the engine then fails its
        requests). The checksum catches bytes half old and half new, which would unpickle.
        (The way back, the mask's rows and then DONE, is checked where stores can be
        reordered: weakly_ordered().)"""
        job = self.seen + 1
        if read_slot(self.slots, SUBMITTED) < job:
            return None
        start, area = job_offset(job), job % AREAS
        data = self.mm[start:start + read_slot(self.slots, JOB_LEN[area])]
        problem = "its checksum does not match"
        if zlib.crc32(data) == read_slot(self.slots, JOB_CRC[area]):
            try:
                step = pickle.loads(data)
                if step.job == job:
                    self.seen, self.unreadable_since = job, None
                    return step
                problem = f"it holds job {step.job}"
            except Exception as err:  # noqa: BLE001 - whatever a torn pickle raises: look again
                problem = repr(err)
        now = time.monotonic()
        if self.unreadable_since is None:
            self.unreadable_since = now
        elif now - self.unreadable_since > UNREADABLE_S:
            raise RuntimeError(f"job {job} in the shared memory stayed unreadable: {problem}")
        return None

    def _apply(self, op: tuple) -> int | None:
        """One matcher change; the seq id when a replayed token is outside the grammar."""
        if op[0] == "new":
            _, seq_id, hold_id = op
            self.matchers[seq_id] = self._xgr.GrammarMatcher(self.holds[hold_id].result())
        elif op[0] == "forget":
            self.matchers.pop(op[1], None)
        elif op[0] == "reset":  # preempted and recomputed, or seen more than it holds
            _, seq_id, tokens = op
            matcher = self.matchers[seq_id]
            matcher.reset()
            for token in tokens:
                if not matcher.accept_token(token):
                    return seq_id
        elif op[0] == "unhold":
            self.holds.pop(op[1], None)
        return None


def serve(conn: Connection, worker: Worker) -> None:
    last = previous_job = time.monotonic()
    poll = POLL_S
    pipe_ready = False
    while True:
        if (job := worker.take_job()) is not None:
            now = time.monotonic()
            poll = min(max((now - previous_job) / POLLS_PER_STEP, POLL_S), MAX_POLL_S)
            previous_job = now
            worker.step(job)
        elif pipe_ready:
            pipe_ready = False
            msg = conn.recv()  # EOFError when the engine is gone: this process ends with it
            if msg is None:
                return
            worker.handle(msg)
        elif poll >= MAX_POLL_S or time.monotonic() - last > ACTIVE_S:
            # Asleep, for long steps (waking this process costs their engine little) and an
            # idle engine: the engine sends a Wake with its next job. Looked again after
            # saying so, so that a job written meanwhile is not left waiting.
            write_slot(worker.slots, ASLEEP, 1)
            if read_slot(worker.slots, SUBMITTED) <= worker.seen:
                pipe_ready = wait_for_pipe(conn, None)
            write_slot(worker.slots, ASLEEP, 0)
            continue
        else:
            pipe_ready = wait_for_pipe(conn, poll)
            continue
        last = time.monotonic()


def wait_for_pipe(conn: Connection, timeout: float | None) -> bool:
    """Sleep up to `timeout` (None: for ever) or until the pipe has a message; whether it has.
    One select() is both the sleep and the look at the pipe: a look costs ~40 us of CPU on a
    VM as time.sleep + Connection.poll (which builds a selector per call), ~22 us as one."""
    return bool(select.select([conn.fileno()], [], [], timeout)[0])


def use_the_engines_cores() -> None:
    """Run on any core of the engine's threads. A child inherits the affinity of the thread
    that started it, and an engine's OpenMP binds that thread to its first core: left so,
    this process would share it with the engine's step loop (2.1x ITL on 2 cores)."""
    import os
    from pathlib import Path
    if not hasattr(os, "sched_setaffinity"):  # macOS: no affinity to inherit
        return
    cores: set[int] = set()
    for task in Path(f"/proc/{os.getppid()}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            cores |= os.sched_getaffinity(int(task.name))
    if cores:
        os.sched_setaffinity(0, cores)


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s grammar %(levelname)s %(message)s")
    try:
        use_the_engines_cores()
        with open(int(argv[1]), "r+b") as shm:
            mm = mmap.mmap(shm.fileno(), 0)
        worker = Worker(conn, mm, conn.recv())
        serve(conn, worker)
    except EOFError:
        return 0
    except BaseException:  # noqa: BLE001 - reported to the engine, which fails its requests
        with contextlib.suppress(OSError):
            conn.send(Failed(traceback.format_exc()))
        return 1
    worker.compiler.shutdown()
    return 0


if __name__ == "__main__":
    # The module's own classes, not __main__'s copies: messages are pickled by class path.
    from flagserve.engine.structured_outputs.worker import main as module_main
    sys.exit(module_main(sys.argv[1:]))
