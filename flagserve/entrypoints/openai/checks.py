"""Checks of a parsed request before anything is tokenized or sent to the engine: what this
server supports, deploy.limits (how much one request may ask for), and the context window.

Each failure is an OpenAI-shaped 400 naming the field. The value ranges of the sampling
fields are SamplingParams' own (the same for the offline API); the limits on the body and
headers are the HTTP server's (size_limits.py, http_server.py).
"""
from __future__ import annotations

from typing import Any

from flagserve.config.schema import ApiLimits
from flagserve.engine import scheduler
from flagserve.engine.sampling_params import cut_tokens, kept_count
from flagserve.entrypoints.openai.engine_client import ModelInfo
from flagserve.entrypoints.openai.errors import OpenAIError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def check_stream(req: Any) -> None:
    """vLLM's rule: stream_options only with stream (else they would be silently unused)."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options needs stream=true", "stream_options")


def check_completion(req: Any) -> None:
    # best_of == n is sampling n and returning them all, which is what happens anyway; a
    # best_of of 0 is refused by name too (its value is falsy).
    refused = {"suffix": req.suffix, "best_of": req.best_of not in (None, req.n)}
    name = next((k for k, asked in refused.items() if asked), None)
    if name is not None:
        raise OpenAIError(400, f"{name} is not supported", name)
    check_stream(req)
    _check_count(req.logprobs, "logprobs")
    _check_count(req.prompt_logprobs, "prompt_logprobs")


def check_chat(req: Any) -> int | None:
    """The number of top logprobs to return per token (None: no logprobs); the fields that
    would change the output and cannot be honoured are refused by the model (unhonoured.py)."""
    check_stream(req)
    if req.top_logprobs is not None:
        if req.top_logprobs and not req.logprobs:  # 0 asks for nothing (vLLM's rule)
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        _check_count(req.top_logprobs, "top_logprobs")
    _check_count(req.prompt_logprobs, "prompt_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _check_count(value: int | None, field: str) -> None:
    """A number of top alternatives per token: the engine's bound is the vocabulary, the API's
    vLLM's default max_logprobs (each one is a dict entry per token in the response)."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(400, f"{field} must be in [0, {MAX_LOGPROBS}]", field)


def check_n(req: Any, info: ModelInfo) -> None:
    """A disaggregated module's decode role takes a request's n sequences together: more than
    it runs at once is refused before the prefill role runs the prompt."""
    if info.max_n is not None and req.n > info.max_n:
        raise OpenAIError(400, f"n={req.n} is more sequences than this model's decode role runs "
                          f"at once (max_num_seqs {info.max_n}): lower n, or raise the decode "
                          "role's max_num_seqs", "n")


def check_priority(req: Any, info: ModelInfo) -> None:
    """The engine's check (scheduler.check_priority), before anything is tokenized."""
    try:
        scheduler.check_priority(req.priority, info.scheduling_policy)
    except ValueError as err:
        raise OpenAIError(400, str(err), "priority") from None


def check_list_lengths(body: dict[str, Any], limits: ApiLimits, max_model_len: int) -> None:
    """On the raw body, before pydantic validates every element of a list (on the event loop:
    1.4 s for the 520k chat messages a 16 MiB body holds): a prompt list longer than a batch
    and than a context window, more messages than deploy.limits.max_messages."""
    _cut_token_prompt(body, max_model_len)
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, list) and len(prompt) > max(limits.max_prompts, max_model_len):
        raise OpenAIError(400, f"prompt: a list of {len(prompt)} is more prompts than this server "
                          f"allows ({limits.max_prompts}, experiment.runner.deploy.limits.max_prompts) "
                          f"and more token ids than the context window ({max_model_len})", "prompt")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise OpenAIError(400, f"messages: {len(messages)} messages is more than this server allows "
                          f"({limits.max_messages}, experiment.runner.deploy.limits.max_messages)",
                          "messages")


def _cut_token_prompt(body: dict[str, Any], max_model_len: int) -> None:
    """A token-id prompt that truncate_prompt_tokens will cut, cut here: a list past the context
    window is what truncation is for, and the ids it drops are never validated."""
    prompt, keep = body.get("prompt"), body.get("truncate_prompt_tokens")
    if not (isinstance(prompt, list) and prompt and type(prompt[0]) is int and type(keep) is int):
        return
    keep = kept_count(keep, max_model_len)
    if keep > 0:  # a bad value is refused when the request is parsed
        side = "right" if body.get("truncation_side") == "right" else "left"
        body["prompt"] = cut_tokens(prompt, keep, side)


def check_limits(req: Any, limits: ApiLimits, num_prompts: int = 1) -> None:
    stops = req.stop if isinstance(req.stop, list) else []
    checks = (  # field, its size, what it counts, the limit's key
        ("n", req.n, "choices", "max_n"),
        ("prompt", num_prompts, "prompts", "max_prompts"),
        ("stop", len(stops), "stop strings", "max_stop"),
        ("stop_token_ids", len(req.stop_token_ids or ()), "token ids", "max_stop"),
        (req.max_tokens_field, req.requested_max_tokens or 0, "tokens", "max_tokens"),
    )
    for field, size, what, key in checks:
        limit = getattr(limits, key)
        if limit is not None and size > limit:
            raise OpenAIError(400, f"{field}: {size} {what} is more than this server allows "
                              f"({limit}, experiment.runner.deploy.limits.{key})", field)


def check_token_ids(info: ModelInfo, prompt: list[int]) -> None:
    check_budget(info, len(prompt), None, "prompt")  # first: an over-long list is never scanned
    if any(not 0 <= t < info.vocab_size for t in prompt):
        raise OpenAIError(400, f"prompt token ids must be in [0, {info.vocab_size})", "prompt")


def check_budget(info: ModelInfo, prompt_len: int, max_tokens: int | None, what: str,
                 cap: int | None = None, max_field: str = "max_tokens") -> int:
    """The max_tokens to generate: as asked, or what the context window leaves, at most `cap`
    (deploy.limits.max_tokens). `what` names the prompt's field, `max_field` the one that
    asked for max_tokens (chat's max_completion_tokens)."""
    limit = info.max_model_len
    if prompt_len == 0:
        raise OpenAIError(400, f"the {what} is empty", what)
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"{max_field} must be at least 1, got {max_tokens}", max_field)
    if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
        asked = prompt_len + (max_tokens or 1)
        raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, "
                          f"you requested {asked} tokens ({prompt_len} in the {what}, "
                          f"{max_tokens or 1} in the completion). Please reduce the length of "
                          f"the {what} or completion.", what if prompt_len >= limit or not max_tokens
                          else max_field)
    if max_tokens is not None:
        return max_tokens
    return min(limit - prompt_len, cap or limit)


def tightest(*caps: int | None) -> int | None:
    """The tightest of the caps set (None: none is)."""
    return min((c for c in caps if c is not None), default=None)
