"""What generate() and LLMEngine.step() return, shaped like vLLM's outputs."""
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum


class FinishReason(str, Enum):
    """Why a sequence ended. A str, so JSON, metric labels and `== "stop"` see the plain
    value, as OpenAI's `finish_reason` and vLLM's `finished_reason` label spell it."""
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the sequence reached max_model_len
    ABORT = "abort"  # the client went away or the request was cancelled

    def __str__(self) -> str:  # Python 3.11+ would print "FinishReason.STOP" in f-strings
        return self.value


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw (unprocessed) distribution."""
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


def logprob_entry(token: int, logprob: float, rank: int, tops: tuple[list[int], list[float]] | None,
                  decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One token's entry: its own Logprob, then the top alternatives (ranks 1..) not already in."""
    entry = {token: Logprob(logprob, rank, decode(token))}
    if tops is not None:
        for top_rank, (tid, lp) in enumerate(zip(*tops), start=1):
            entry.setdefault(tid, Logprob(lp, top_rank, decode(tid)))
    return entry


# One dict per generated token: the sampled token and the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token, as vLLM: None for the first (nothing scores it), then the token's own
# entry and the top-N alternatives of the distribution that predicted it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine ended the request itself (a failed KV transfer)
    # SamplingParams.prompt_logprobs: complete, from the output that has the first token on
    # (DELTA outputs: that one output only); None before, and when not asked for.
    prompt_logprobs: PromptLogprobs | None = None


def merge_completion(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """`b` following `a` (two DELTA outputs of the same choice) as one delta."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return CompletionOutput(b.index, a.text + b.text, a.token_ids + b.token_ids,
                            b.cumulative_logprob, logprobs, b.finish_reason, b.stop_reason)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """`b` following `a` (two DELTA outputs of the same request) as one delta."""
    by_index = {c.index: c for c in a.outputs}
    outs = [c if (prev := by_index.pop(c.index, None)) is None else merge_completion(prev, c)
            for c in b.outputs]
    outs.extend(by_index.values())
    outs.sort(key=lambda c: c.index)
    # A DELTA stream carries prompt_logprobs once: keep them from whichever delta had them.
    return replace(b, outputs=outs, prompt_logprobs=b.prompt_logprobs or a.prompt_logprobs)
