"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has one token budget shared by decodes and prefill chunks. Running sequences go
first, oldest first; when the cache runs out of blocks the newest running sequence is
preempted (its blocks freed, recomputed later, usually straight from the prefix cache). Waiting
sequences are admitted FCFS while budget, sequence slots and blocks last. Under the priority
policy (vLLM's) both queues are kept in (priority, arrival) order instead, so "oldest" reads
"first in that order" everywhere above: the batch fills by priority, and the sequence preempted
is the one of the latest priority.
"""
import bisect
from collections import deque
from dataclasses import dataclass, field

from flagserve.engine.block_manager import BlockManager
from flagserve.engine.engine_args import SchedulingPolicy
from flagserve.engine.sequence import Sequence, SequenceStatus


def check_priority(priority: int, policy: SchedulingPolicy) -> None:
    """vLLM's rule: an int64, and other than 0 only under the priority policy (where else it
    would be unused). ValueError naming it."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
        raise ValueError(f"priority must be an integer in [-2**63, 2**63 - 1], got {priority!r}")
    if priority and policy != "priority":
        raise ValueError(f"priority {priority} needs scheduling_policy 'priority' (the engine "
                         "serves first come, first served): send 0, or set "
                         "engine_args.scheduling_policy=priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    policy: SchedulingPolicy = "fcfs"


@dataclass
class ScheduledBatch:
    """Sequences and their new-token counts, decodes (one new token) first."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    admitted: list[Sequence]  # of seqs, those taken from the waiting queue this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class _Step:
    """A step being filled: its token budget left and what it takes."""
    budget: int
    decodes: list[Sequence] = field(default_factory=list)  # one new token each; they lead the batch
    chunks: dict[Sequence, int] = field(default_factory=dict)
    admitted: list[Sequence] = field(default_factory=list)

    def take(self, seq: Sequence, num_new: int) -> None:
        if num_new == 1:
            self.decodes.append(seq)
        else:
            self.chunks[seq] = num_new
        self.budget -= num_new

    def batch(self) -> ScheduledBatch:
        return ScheduledBatch(self.decodes + list(self.chunks),
                              [1] * len(self.decodes) + list(self.chunks.values()), self.admitted)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._queue(self.waiting, seq, front=False)

    def _queue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence, front: bool) -> None:
        """FCFS: at the front (a preempted sequence goes first again) or the back; priority:
        in (priority, arrival) order."""
        if self.config.policy == "fcfs":
            if front:
                queue.appendleft(seq)
            else:
                queue.append(seq)
            return
        queue.insert(bisect.bisect_right(queue, _order(seq), key=_order), seq)

    def schedule(self) -> ScheduledBatch:
        step = _Step(self.config.max_num_batched_tokens)
        # After a preemption the cache is full: admitting more would only thrash.
        if not self._schedule_running(step):
            self._admit_waiting(step)
        return step.batch()

    def _schedule_running(self, step: _Step) -> bool:
        """The running sequences' next tokens, oldest first. True when blocks ran out and the
        newest were preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and step.budget > 0:
            seq = self.running[i]
            i += 1
            if seq.num_pending and seq.reaches_length(self.config.max_model_len):
                continue  # its last token is in flight (async scheduling): a step more is waste
            num_new = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            while not self.block_manager.append_slots(seq, num_new):
                victim = self.running.pop()  # the newest; never one already scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return True  # everything after it is gone too
            step.take(seq, num_new)
        return preempted

    def _admit_waiting(self, step: _Step) -> None:
        """Waiting sequences in order while budget, sequence slots and blocks last."""
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.block_manager.block_size
            if not self.config.enable_chunked_prefill and remaining > step.budget:
                break
            num_new = min(remaining, step.budget)
            if not self.block_manager.can_admit(hits, num_new):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hits)
            self.block_manager.append_slots(seq, num_new)  # can_admit counted its blocks
            seq.status = SequenceStatus.RUNNING
            self._queue(self.running, seq, front=False)
            step.admitted.append(seq)
            step.take(seq, num_new)

    def queued_prompt_tokens(self) -> int:
        """Tokens still to prefill: waiting sequences whole, running ones' unfinished chunks
        (a decode's one pending token, its last sampled, is not a prompt's)."""
        queued = sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)
        for s in self.running:
            left = s.num_tokens - s.num_computed_tokens
            queued += left if left > 1 or s.num_output_tokens == 0 else 0
        return queued

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        seq.reset_for_recompute()
        self._queue(self.waiting, seq, front=True)
        self.num_preemptions += 1

    def park(self, seq: Sequence) -> None:
        """Take a running sequence off the batch, keeping its blocks (a KV transfer reads them)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED

    def resume(self, seq: Sequence) -> None:
        """A sequence whose blocks and K/V are in place (imported) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self._queue(self.running, seq, front=False)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_sequence(seq)
        elif seq.status == SequenceStatus.PARKED:
            self.block_manager.free_sequence(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED


def _order(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id
