"""OpenAI response bodies built from engine chunks: completions, chat, streams, errors.

Plain dicts, not pydantic models: this runs once per streamed chunk.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from flagserve.engine.outputs import SampleLogprobs
from flagserve.serve.messages import ChoiceDelta


class OpenAIError(Exception):
    """Becomes an HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Header:
    """Fields every response and chunk of one request repeats."""
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


# Completions (legacy) logprobs: parallel lists.
@dataclass
class CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entries: SampleLogprobs, token_ids: list[int], offset: int, top_n: int) -> None:
        for tid, entry in zip(token_ids, entries):
            chosen = entry[tid]
            text = chosen.decoded_token or ""
            self.tokens.append(text)
            self.token_logprobs.append(chosen.logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            self.top_logprobs.append({(lp.decoded_token or ""): lp.logprob
                                      for _, lp in ranked[:max(top_n, 0)] if lp.rank})
            self.text_offset.append(offset)
            offset += len(text)

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def chat_logprobs(entries: SampleLogprobs, token_ids: list[int], top_n: int) -> list[dict]:
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        ranked = sorted((lp for lp in entry.values() if lp.rank), key=lambda lp: lp.rank)
        out.append({**_token(chosen.decoded_token, chosen.logprob),
                    "top_logprobs": [_token(lp.decoded_token, lp.logprob) for lp in ranked[:top_n]]})
    return out


def _token(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_choice(index: int, delta: ChoiceDelta, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "text": delta.text, "logprobs": logprobs,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


def chat_choice(index: int, text: str, delta: ChoiceDelta, logprobs: list | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


def error_message(err: BaseException) -> str:
    """The user's message of an exception raised in another deployment (RayTaskError wraps it)."""
    cause = getattr(err, "cause", None)
    return str(cause if cause is not None else err).strip().splitlines()[-1]


def engine_dead_message(err: BaseException) -> str:
    return (f"the engine of this replica stopped ({error_message(err)}); Ray Serve is restarting "
            "it: retry in a few seconds")
