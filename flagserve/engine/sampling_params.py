"""Per-request sampling parameters, named and defaulted as in vLLM."""
import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature",
                 f"must be >= 0, got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
                 f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        _require(self.seed is None or _is_int(self.seed), "seed",
                 f"must be an integer or None, got {self.seed!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                 "max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
                 "logprobs", f"must be an integer >= 0 or None, got {self.logprobs!r}")
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            _require(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
                     "stop", f"must be a string or a list of strings, got {self.stop!r}")
            self.stop_list = list(self.stop)
        _require(all(s for s in self.stop_list), "stop", "must not contain empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _require(isinstance(self.stop_token_ids, (list, tuple))
                 and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
