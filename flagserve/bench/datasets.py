"""Benchmark prompts: random, shared-prefix and JSONL, as vLLM's `bench serve` builds them,
and json-schema: random prompts whose requests each carry a JSON schema (structured outputs).

Random prompts are built from the tokenizer's vocabulary, then decoded and re-encoded until
the text tokenizes to exactly the asked length, so `prompt_len` is what the server sees for a
/v1/completions request (special tokens the tokenizer adds, e.g. BOS, are counted).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

from flagserve.config.schema import BenchDataset

MAX_ROUNDS = 16  # decode/re-encode rounds before giving up on one prompt


@dataclass
class SampleRequest:
    prompt: str  # the request's own text; after `prefix` for shared-prefix prompts
    prompt_len: int  # tokens of prefix + prompt as a completions request, special tokens included
    output_len: int | None  # max_tokens (None: the server's default)
    prefix: str = ""  # shared system prompt (chat: the system message)
    schema: dict[str, Any] | None = None  # json-schema: the output's schema (response_format)

    @property
    def text(self) -> str:
        return self.prefix + self.prompt

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat request: the prefix as the system message, the prompt as the user's."""
        system = [{"role": "system", "content": self.prefix}] if self.prefix else []
        return system + [{"role": "user", "content": self.prompt}]


def lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's range ratio)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class PromptMaker:
    """Texts of an exact token count from random vocabulary tokens."""

    def __init__(self, tokenizer: Any, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.num_special = tokenizer.num_special_tokens_to_add()
        special = set(tokenizer.all_special_ids)
        # Tokens that decode to clean text on their own: random picks then round-trip well.
        self.candidates = [i for i in range(len(tokenizer)) if i not in special
                           and "\ufffd" not in (s := tokenizer.decode([i])) and s.strip()]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _random(self, n: int) -> list[int]:
        return [self.rng.choice(self.candidates) for _ in range(n)]

    def text(self, num_tokens: int, head: str = "") -> str:
        """A text T with len(encode(head + T)) == len(encode(head)) + num_tokens and the
        head's tokens unchanged (the shared prefix stays a prefix in token space)."""
        head_ids = self.encode(head) if head else []
        tail = self._random(num_tokens)
        for _ in range(MAX_ROUNDS):
            text = self.tok.decode(tail)
            ids = self.encode(head + text)
            if ids[:len(head_ids)] != head_ids:  # merged across the boundary: new first token
                tail = self._random(1) + tail[1:]
                continue
            got = ids[len(head_ids):]
            if len(got) == num_tokens:
                return text
            tail = got[:num_tokens] if len(got) > num_tokens else got + self._random(num_tokens - len(got))
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")


def random_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    maker = PromptMaker(tokenizer, seed)
    rng = random.Random(seed)
    ins = lengths(input_len, range_ratio, num_prompts, rng)
    outs = lengths(output_len, range_ratio, num_prompts, rng)
    return [SampleRequest(maker.text(max(1, n - maker.num_special)), max(n, maker.num_special + 1), o)
            for n, o in zip(ins, outs)]


# A server sees a few schemas again and again. Each holds an array of at least OPEN items, so
# no output can close before max_tokens (up to ~1000): every request runs to its max_tokens as
# a random one does, and the ITLs compare.
OPEN = 512
_ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                          "tag": {"enum": ["red", "green", "blue"]},
                                          "ok": {"type": "boolean"}},
         "required": ["id", "tag", "ok"], "additionalProperties": False}
BENCH_SCHEMAS = (
    {"type": "array", "items": _ITEM, "minItems": OPEN},
    {"type": "object", "required": ["words"], "additionalProperties": False,
     "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                               "minItems": OPEN}}},
    {"type": "array", "items": {"type": "number"}, "minItems": OPEN},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "scores": {"type": "array", "items": {"type": "integer"},
                                                 "minItems": OPEN}},
     "required": ["name", "scores"], "additionalProperties": False},
)


def json_schema_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                        range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """The random dataset's prompts and lengths, request i constrained by BENCH_SCHEMAS[i % 4]."""
    samples = random_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    for i, sample in enumerate(samples):
        sample.schema = BENCH_SCHEMAS[i % len(BENCH_SCHEMAS)]
    return samples


def shared_prefix_dataset(tokenizer: Any, num_prompts: int, prefix_len: int, input_len: int,
                          output_len: int, range_ratio: float = 0.0, seed: int = 0,
                          num_prefixes: int = 1) -> list[SampleRequest]:
    """Every request starts with one of `num_prefixes` system prompts of `prefix_len` tokens,
    drawn at random per request, then `input_len` tokens of its own: what prefix caching is
    for, and with several prefixes across replicas what prefix-aware routing is for (drawn,
    not taken in turn, so that round-robin routing does not keep each prefix on one replica
    by accident)."""
    maker = PromptMaker(tokenizer, seed)
    rng = random.Random(seed)
    prefixes = [maker.text(max(1, prefix_len - maker.num_special)) for _ in range(num_prefixes)]
    ins = lengths(input_len, range_ratio, num_prompts, rng)
    outs = lengths(output_len, range_ratio, num_prompts, rng)
    picks = [rng.randrange(num_prefixes) for _ in range(num_prompts)] if num_prefixes > 1 \
        else [0] * num_prompts
    samples = []
    for n, o, k in zip(ins, outs, picks):
        base = len(maker.encode(prefixes[k])) + maker.num_special
        samples.append(SampleRequest(maker.text(n, head=prefixes[k]), base + n, o,
                                     prefix=prefixes[k]))
    return samples


def jsonl_dataset(path: str | Path, num_prompts: int | None, output_len: int | None,
                  tokenizer: Any = None) -> list[SampleRequest]:
    """One JSON object per line: {"prompt": str, "output_len" or "max_tokens": int (optional)}.
    Lines without a length get `output_len`. Takes the first `num_prompts` lines."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str):
            raise ValueError(f"{path}:{number}: \"prompt\" must be a string")
        n_out = row.get("output_len", row.get("max_tokens", output_len))
        n_in = len(tokenizer.encode(prompt)) if tokenizer is not None else 0
        out.append(SampleRequest(prompt, n_in, n_out))
        if num_prompts is not None and len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def warmup_samples(samples: list[SampleRequest], warmup: int) -> list[SampleRequest]:
    """What a warm-up sends (warmup_indices' samples, up to 8 tokens out), each prompt
    reversed: the timed run must not find its first prompts in the prefix cache (a shared
    prefix stays as it is: caching it is what the timed requests after the first get too)."""
    return [replace(samples[i], prompt=samples[i].prompt[::-1],
                    output_len=min(samples[i].output_len or 8, 8))
            for i in warmup_indices(samples, warmup)]


def warmup_indices(samples: list[SampleRequest], warmup: int) -> list[int]:
    """The samples a warm-up sends: the first `warmup`, then the first of each schema they
    miss, so that no timed request pays a grammar's first compile (or the grammar process's
    start); none when warmup is 0."""
    if not warmup:
        return []
    chosen = list(range(min(warmup, len(samples))))
    seen = [samples[i].schema for i in chosen]
    for i, sample in enumerate(samples):
        if sample.schema is not None and sample.schema not in seen:
            chosen.append(i)
            seen.append(sample.schema)
    return chosen


def build_dataset(name: BenchDataset, tokenizer: Any, num_prompts: int, input_len: int,
                  output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
                  path: str | None = None, seed: int = 0,
                  num_prefixes: int = 1) -> list[SampleRequest]:
    if name == "random":
        return random_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    if name == "json-schema":
        return json_schema_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    if name == "shared-prefix":
        return shared_prefix_dataset(tokenizer, num_prompts, prefix_len, input_len, output_len,
                                     range_ratio, seed, num_prefixes)
    if name == "jsonl":
        if not path:
            raise ValueError("the jsonl dataset needs a path")
        return jsonl_dataset(path, num_prompts, output_len, tokenizer)
    raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(get_args(BenchDataset))}")
