"""The request fields that constrain the output: OpenAI's `response_format` and vLLM's
`structured_outputs` body field, both turned into the engine's StructuredOutputsParams.

A constraint that does not parse is a 400 naming the body field it came from
(`response_format.json_schema.schema`, `structured_outputs.regex`), not the engine's name.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, model_validator

from flagserve.engine.structured_outputs.params import StructuredOutputsParams
from flagserve.entrypoints.openai.unhonoured import Strict


class JsonSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # always strict here: the grammar is the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"json_schema is read only with type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputsBody(Strict):
    """vLLM's `structured_outputs`; unknown keys are refused so that a backend option this
    server lacks (structural_tag, ...) is not silently ignored."""
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _build("response_format", json_object=True)
    if fmt.json_schema is None:
        raise ValueError("SamplingParams.response_format.json_schema is required when type is "
                         "'json_schema'")
    schema = fmt.json_schema.schema_
    field = "response_format.json_schema.schema"
    return _build(field, json=schema) if schema is not None else _build(field, json_object=True)


def _build(field: str, **kind: Any) -> StructuredOutputsParams:
    """Re-raise the engine's ValueError under the body's field name (the ingress makes a 400
    with `param` from the message's first word)."""
    try:
        return StructuredOutputsParams(**kind)
    except ValueError as err:
        detail = str(err).split(" ", 1)[1]
        raise ValueError(f"SamplingParams.{field} {detail}") from None


def constraint(response_format: ResponseFormat | None,
               body: StructuredOutputsBody | None) -> StructuredOutputsParams | None:
    """The request's constraint, or None. Raises ValueError naming the field."""
    if body is not None:
        if response_format is not None and response_format.type != "text":
            raise ValueError("SamplingParams.structured_outputs cannot be combined with response_format")
        # The engine's errors already name structured_outputs.<field>.
        return StructuredOutputsParams(**body.model_dump(exclude_none=True, by_alias=True))
    if response_format is not None:
        return _from_response_format(response_format)
    return None
