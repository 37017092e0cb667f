"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`.

- `none`: no tools reach the template, the output is text.
- `auto`: the tools reach the chat template (apply_chat_template(tools=...)), the model decides,
  and the model family's parser (tool_parsers.py) finds its calls in the output. A template
  that does not show `tools` (SmolLM2's, Llama 2's) would leave the model unaware of them: the
  tools then go into the system message in the Hermes format, the default parser's
  (template_input.py).
- `required` / a named function: the output is constrained (structured outputs) to a JSON list
  of calls / to the named function's arguments, so the arguments always parse and match the
  function's parameter schema, whatever the model or its template.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from flagserve.engine.structured_outputs.params import StructuredOutputsParams
from flagserve.entrypoints.openai.unhonoured import Strict

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function declared without parameters


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # whatever else the template may show
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # always strict here: the grammar is the schema

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (value or {}).get("type", "object")
        if kind != "object":  # OpenAI's rule: a call's arguments are a JSON object
            raise ValueError(f"parameters must be a JSON schema of type 'object', got {kind!r}")
        return value


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolMode = Literal["none", "auto", "required", "named"]


def tool_mode(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolMode:
    """Raises ValueError naming the field. OpenAI's defaults: auto with tools, else none."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools or ()}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is "
                             "not in tools")
        return "named"
    if choice in ("auto", "required") and not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    return choice


def _parameters(tool: ToolDef) -> dict[str, Any]:
    """The schema a call's arguments follow: an object, as OpenAI and vLLM read it. A schema
    without a `type` admits any JSON value (a number for arguments) unless its keywords imply
    an object; one that combines or refers to others is left whole (a type beside them would
    be a constraint beside a $ref, params.py)."""
    params = tool.function.parameters
    if not params:
        return ANY_OBJECT
    if "type" in params or any(k in params for k in ("$ref", "anyOf", "oneOf", "allOf")):
        return params
    return {**params, "type": "object"}


def calls_schema(tools: list[ToolDef], parallel: bool) -> dict[str, Any]:
    """`required`: a JSON list of {"name", "arguments"}, each call one of the tools. A tool's
    parameters that refer to their own root ($ref "#/$defs/X", pydantic's nested models) go
    under the list's $defs, their references rewritten to point there: in place, "#" would
    be the list."""
    defs: dict[str, Any] = {}
    call = []
    for i, tool in enumerate(tools):
        arguments = _parameters(tool)
        if '"$ref"' in json.dumps(arguments):
            defs[f"tool{i}"] = _rerooted(arguments, f"#/$defs/tool{i}")
            arguments = {"$ref": f"#/$defs/tool{i}"}
        call.append({"type": "object", "additionalProperties": False,
                     "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                    "arguments": arguments}})
    return {"type": "array", "minItems": 1, "items": {"anyOf": call},
            **({} if parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}


def _rerooted(value: Any, root: str) -> Any:
    """`value` with every local $ref ("#...") made relative to `root`."""
    if isinstance(value, list):
        return [_rerooted(v, root) for v in value]
    if not isinstance(value, dict):
        return value
    return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rerooted(v, root)) for k, v in value.items()}


def tool_constraint(tools: list[ToolDef] | None, mode: ToolMode, named: str | None,
                    parallel: bool) -> StructuredOutputsParams | None:
    """The constraint for `required` and named calls; ValueError naming `tools` when a
    function's parameters are not a schema the grammar compiler takes (under `auto` too: the
    model may call any of them, and a client parses the arguments by that schema)."""
    if mode == "required":
        return _json_constraint(calls_schema(tools or [], parallel))
    if mode == "named":
        return _json_constraint(_parameters(next(t for t in tools or () if t.function.name == named)))
    if mode == "auto":
        for tool in tools or ():
            _json_constraint(_parameters(tool))
    return None


def _json_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as err:
        raise ValueError(f"SamplingParams.tools hold a function whose parameters are not a JSON "
                         f"schema this server takes: {str(err).split(' ', 1)[1]}") from None
