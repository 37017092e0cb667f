"""One generation stream: its tokens, its place in the KV cache and its sampling state."""
import enum
from dataclasses import dataclass, field
from itertools import count

from flagserve.engine.outputs import FinishReason, PromptLogprobs, SampleLogprobs
from flagserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PARKED = enum.auto()  # prefilled with its first token, its blocks kept for a KV transfer
    FINISHED = enum.auto()


_seq_ids = count()


@dataclass(eq=False)
class Sequence:
    """A request with n > 1 owns n sequences that share the prompt (and its cached blocks)."""

    request_id: str
    index: int  # position among the request's n outputs
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    seed: int | None = None  # seeded requests: the sampling runner keeps a generator from it
    priority: int = 0  # scheduling_policy "priority": lower runs earlier
    # Imported from a prefill engine: the generator's state after the first token (resumed
    # instead of seeding afresh); exported: the state to hand over.
    generator_state: bytes | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Sampled on the device, not yet in token_ids (async scheduling: the step in flight)
    num_pending: int = 0
    num_cached_tokens: int = 0  # of those, served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    cumulative_logprob: float | None = None  # tracked when the request asks for logprobs
    logprobs: SampleLogprobs | None = None
    # The request's first sequence, when it asks for prompt_logprobs: [None] plus one entry
    # per prompt token scored so far (prompt_logprobs.py).
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        """Pending tokens included: what the scheduler and the step message count."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def reaches_length(self, max_model_len: int) -> bool:
        """Its tokens (pending included) are as many as max_tokens or the model allows: it ends
        by length once they land, and no step after them may be scheduled."""
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and self.num_output_tokens >= max_tokens)
                or self.num_tokens >= max_model_len)

    @property
    def scores_prompt(self) -> bool:
        """Prompt tokens still to score: their rows must be computed, not found cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache state, keep every token generated so far."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
