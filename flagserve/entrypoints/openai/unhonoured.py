"""The OpenAI fields FlagServe accepts without acting on them, and those it refuses.

Never a silent ignore: a field that would change the output and that FlagServe cannot honour
is a 400 naming it (an unknown field too: the request models forbid extras, and the official
client sends only the parameters its caller gave). Fields that only label or route a request
on OpenAI's side (user, metadata, store, service_tier, prompt caching hints) change nothing
in what is generated, so they are accepted and unused.
"""
from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, StrictBool, field_validator, model_validator

# field -> why it cannot be honoured (the 400's message)
REFUSED_CHAT = {
    "functions": "the legacy functions API is not served; use tools",
    "function_call": "the legacy functions API is not served; use tool_choice",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "verbosity": "verbosity is not served",
    "moderation": "moderation is not served",
}
# An unknown field named here gets the field that does the same in FlagServe.
RENAMED = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
           "guided_choice": "structured_outputs.choice",
           "guided_grammar": "structured_outputs.grammar", "max_new_tokens": "max_tokens"}


class Strict(BaseModel):
    """Unknown fields refused; a null in an optional field that cannot hold one reads as its
    default. OpenAI's optional fields are nullable and clients send null for "not set" (the
    official one for an argument given as None), as vLLM takes it; a field whose type holds
    null keeps it (completions' `max_tokens: null`: up to the context), and a required one
    stays required."""
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()
                or _holds_null(fields[k].annotation)}


def _holds_null(annotation: Any) -> bool:
    return annotation is Any or type(None) in get_args(annotation)


class OutputNeutral(Strict):
    """Accepted, unused: none of them changes what is generated."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None


class ChatRefused(Strict):
    """OpenAI chat fields that would change the output: only null (or text-only) passes."""

    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None

    @field_validator(*REFUSED_CHAT)
    @classmethod
    def _refuse(cls, value: Any, info: Any) -> Any:
        # An empty web_search_options asks for search: only null passes.
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported: {REFUSED_CHAT[info.field_name]}")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise ValueError("only the text modality is served")
        return value


def unknown_field_message(field: str) -> str:
    hint = f"; FlagServe's field for it is {RENAMED[field]}" if field in RENAMED else ""
    return (f"{field}: unknown field (FlagServe refuses what it would otherwise ignore{hint})")
