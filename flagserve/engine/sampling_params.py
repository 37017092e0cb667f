"""Per-request sampling parameters, named and defaulted as in vLLM.

Every field is range-checked here, so the offline API and the server (which builds its
SamplingParams from the request body) reject the same values. The bounds are what the engine
can hold: integers that torch's int64 tensors and generators accept, floats that stay finite
in the sampler's float32. `validate()` runs again in LLMEngine.add_request, because params that
were mutated or unpickled (the engine process receives them pickled) skip __post_init__.
"""
import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from flagserve.engine.structured_outputs.params import StructuredOutputsParams

INT32_MAX = 2**31 - 1  # counts and token ids: far above any vocabulary or context length
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # torch.Generator.manual_seed takes an int64
FLOAT32_MAX = 3.4028234663852886e38  # past it the sampler's float32 tensors hold inf
FLOAT32_TINY = 1.1754943508222875e-38  # below it a float32 divisor is (nearly) zero
MAX_N = 1024  # every sample is a sequence the engine allocates at once (deploy.limits.max_n is lower)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values, either sign
# bad_words: token sequences per request and their tokens in all, checked at every step
# (vLLM's VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 128, 1024


TruncationSide = Literal["left", "right"]


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")


def _short(value: object) -> str:
    """A value for a message, cut: lists of token ids may be long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object, low: int = 0, high: int = INT32_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: object, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX) -> bool:
    """A finite int or float in [low, high] (NaN and infinities never are)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and low <= value <= high)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Per prompt token: its logprob and the top-N alternatives (vLLM's; scoring, lm-eval). The
    # prompt's rows are computed then, never read from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False (vLLM's): token ids only, no text (completions' text and logprobs' decoded_token
    # stay empty); for benchmarks of random weights, whose token soup says nothing. No stop
    # strings then: they are matched on the text.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # token id -> a number added to its logit before penalties and sampling (OpenAI's
    # logit_bias: +-100 all but forces or bans it). Logprobs stay the model's own.
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these token ids (logprobs stay the model's own)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. Each is tokenized as it stands and with a leading space
    # (a word mid-text); the last token of such a sequence is banned wherever the tokens
    # before it end the output so far (bad_words.py).
    bad_words: list[str] | None = None
    # vLLM's: keep only this many prompt tokens (-1: as many as leave room for one output
    # token), cut from `truncation_side` (cut_tokens: None cuts the left of a text's tokens
    # and keeps the special tokens its tokenizer put around it, as vLLM's default).
    truncate_prompt_tokens: int | None = None
    truncation_side: TruncationSide | None = None
    # vLLM's: arbitrary data for custom sampling code, unused by the engine (as vLLM's in-tree
    # samplers leave it)
    extra_args: dict[str, Any] | None = None
    stop_list: list[str] = field(init=False, repr=False)
    # bad_words as token sequences: set by the engine, which holds the tokenizer
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range; normalise stop lists."""
        self._check_sampling()
        self._check_lengths()
        self._check_flags()
        self._check_stops()
        self._check_vocabulary_limits()
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                     f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    def _check_sampling(self) -> None:
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None  # vLLM's: -1 asks for no seed
        _require(is_int(self.n, 1, MAX_N), "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        _require(is_number(self.temperature, 0), "temperature",
                 f"must be a number in [0, 3.4e38] (finite in float32), got {self.temperature!r}")
        _require(is_number(self.top_p, 0, 1) and self.top_p > 0, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(self.top_k == -1 or is_int(self.top_k), "top_k",
                 f"must be -1 or 0 (disabled) or an integer in [1, {INT32_MAX}], got {self.top_k!r}")
        _require(is_number(self.min_p, 0, 1), "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(is_number(value, -2, 2), name, f"must be in [-2, 2], got {value!r}")
        _require(is_number(self.repetition_penalty, FLOAT32_TINY), "repetition_penalty",
                 f"must be a number in [1.2e-38, 3.4e38] (> 0, finite in float32), "
                 f"got {self.repetition_penalty!r}")
        _require(self.seed is None or is_int(self.seed, SEED_MIN, SEED_MAX), "seed",
                 f"must be None or an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        # The message names the first bad entry: the dict may hold tens of thousands.
        bias = self.logit_bias
        if bias is None:
            return
        _require(isinstance(bias, dict), "logit_bias",
                 f"must be a dict of token id -> bias, got {type(bias).__name__}")
        bad = next(((t, b) for t, b in bias.items()
                    if not (is_int(t) and is_number(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS))), None)
        if bad is not None:
            _require(False, "logit_bias", f"must map token ids in [0, {INT32_MAX}] to numbers in "
                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad[0]!r}: {bad[1]!r}")

    def _check_vocabulary_limits(self) -> None:
        allowed = self.allowed_token_ids
        _require(allowed is None or (isinstance(allowed, (list, tuple)) and len(allowed) > 0
                                     and all(map(is_int, allowed))), "allowed_token_ids",
                 f"must be None or a non-empty list of token ids in [0, {INT32_MAX}], "
                 f"got {_short(allowed)}")
        _require(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
                 f"must be None or a dict, got {type(self.extra_args).__name__}")
        words = self.bad_words
        _require(words is None or (isinstance(words, (list, tuple))
                                   and len(words) <= MAX_BAD_WORDS
                                   and all(isinstance(w, str) and w.strip() for w in words)),
                 "bad_words", f"must be None or a list of at most {MAX_BAD_WORDS} words (non-blank "
                 f"strings), got {_short(words)}")

    def _check_lengths(self) -> None:
        _require(self.max_tokens is None or is_int(self.max_tokens, 1), "max_tokens",
                 f"must be None or an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        _require(is_int(self.min_tokens), "min_tokens",
                 f"must be an integer in [0, {INT32_MAX}], got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or is_int(value), name,
                     f"must be None or an integer in [0, {INT32_MAX}], got {value!r}")
        keep = self.truncate_prompt_tokens
        _require(keep is None or keep == -1 or is_int(keep, 1), "truncate_prompt_tokens",
                 f"must be None, -1 (the context window) or an integer in [1, {INT32_MAX}], "
                 f"got {keep!r}")
        _require(self.truncation_side in (None, "left", "right"), "truncation_side",
                 f"must be None, 'left' or 'right', got {self.truncation_side!r}")

    def _check_flags(self) -> None:
        # Checked by type: the detokenizer takes skip_special_tokens as a bool, and a value that
        # reached it would fail the step and every request of the batch with it.
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        _require(isinstance(self.output_kind, RequestOutputKind), "output_kind",
                 f"must be a RequestOutputKind, got {self.output_kind!r}")

    def _check_stops(self) -> None:
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            _require(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
                     "stop", f"must be a string or a list of strings, got {self.stop!r}")
            self.stop_list = list(self.stop)
        _require(all(s for s in self.stop_list), "stop", "must not contain empty strings")
        _require(self.detokenize or not self.stop_list, "stop",
                 "needs detokenize=True: stop strings are matched on the text")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _require(isinstance(self.stop_token_ids, (list, tuple)) and all(map(is_int, self.stop_token_ids)),
                 "stop_token_ids", f"must be a list of token ids in [0, {INT32_MAX}], "
                 f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    def check_vocab(self, vocab_size: int) -> None:
        """What only the model bounds: token ids the sampler indexes its logits with (a
        min_tokens ban on stop_token_ids) and the top-N logprobs it takes. Past the vocabulary
        they fail the step, and with it every request in the batch."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _require(not bad, "stop_token_ids", f"must be < the vocabulary size {vocab_size}, got {bad[:5]}")
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            _require(not bad, name, f"token ids must be < the vocabulary size {vocab_size}, "
                     f"got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or value <= vocab_size, name,
                     f"must be <= the vocabulary size {vocab_size}, got {value}")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def needs_output_tokens(self) -> bool:
        """Whether the sampler reads the output so far: penalties count it, and a bad word
        of several tokens is banned only after its first ones."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    def check_context(self, max_model_len: int) -> None:
        """What only the context window bounds: a truncation must leave room for output."""
        keep = self.truncate_prompt_tokens
        _require(keep is None or keep < max_model_len, "truncate_prompt_tokens",
                 f"must be less than max_model_len ({max_model_len}) to leave room for output, "
                 f"got {keep}")

    def kept_tokens(self, max_model_len: int) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (None: all)."""
        self.check_context(max_model_len)
        return kept_count(self.truncate_prompt_tokens, max_model_len)

    def truncated(self, prompt_token_ids: list[int], max_model_len: int,
                  edges: tuple[int, int] = (0, 0)) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it; `edges`: the special tokens the
        tokenizer put before and after a text's (models/tokenizer.py special_edges)."""
        keep = self.kept_tokens(max_model_len)
        if keep is None:
            return prompt_token_ids
        return cut_tokens(prompt_token_ids, keep, self.truncation_side, edges)


def kept_count(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """truncate_prompt_tokens as a count: -1 is as many as leave room for one output token."""
    return max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def cut_tokens(ids: list[int], keep: int, side: TruncationSide | None,
               edges: tuple[int, int] = (0, 0)) -> list[int]:
    """`keep` of `ids`: the first (right), the last (left) or, with no side, the last with the
    `edges` (head, tail) of special tokens kept in place: HF's truncation of an encoded text,
    which is vLLM's default (a BOS stays first, where attention leans on it)."""
    if len(ids) <= keep:
        return ids
    if side == "right":
        return ids[:keep]
    head, tail = edges if side is None else (0, 0)
    if keep <= head + tail:
        return ids[-keep:]
    body = keep - head - tail
    return ids[:head] + ids[len(ids) - tail - body:]
