"""Per-request sampling parameters, named and defaulted as in vLLM.

Every field is range-checked here, so the offline API and the server (which builds its
SamplingParams from the request body) reject the same values. The bounds are what the engine
can hold: integers that torch's int64 tensors and generators accept, floats that stay finite
in the sampler's float32. `validate()` runs again in LLMEngine.add_request, because params that
were mutated or unpickled (the engine process receives them pickled) skip __post_init__.
"""
import enum
import math
from dataclasses import dataclass, field

from flagserve.engine.structured_outputs.params import StructuredOutputsParams

INT32_MAX = 2**31 - 1  # counts and token ids: far above any vocabulary or context length
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # torch.Generator.manual_seed takes an int64
FLOAT32_MAX = 3.4028234663852886e38  # past it the sampler's float32 tensors hold inf
FLOAT32_TINY = 1.1754943508222875e-38  # below it a float32 divisor is (nearly) zero
MAX_N = 1024  # every sample is a sequence the engine allocates at once (deploy.limits.max_n is lower)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values, either sign


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")


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
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range; normalise stop lists."""
        self._check_sampling()
        self._check_lengths()
        self._check_flags()
        self._check_stops()
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                     f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    def _check_sampling(self) -> None:
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
        bad = [t for t in self.logit_bias or () if t >= vocab_size]
        _require(not bad, "logit_bias", f"token ids must be < the vocabulary size {vocab_size}, "
                 f"got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or value <= vocab_size, name,
                     f"must be <= the vocabulary size {vocab_size}, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
