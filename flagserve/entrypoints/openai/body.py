"""A request body -> a JSON object, or an OpenAI-shaped 400 naming what is wrong with it.

JSON admits what the rest of the server cannot take: a lone UTF-16 surrogate ("\\ud800" is
valid JSON, but no tokenizer or UTF-8 encoder accepts the string it decodes to), nesting
deeper than Python's recursion limit, integers longer than Python's 4300-digit limit.
"""
from __future__ import annotations

import json
import re
from typing import Any

from flagserve.entrypoints.openai.errors import OpenAIError

_SURROGATE = re.compile("[\ud800-\udfff]")
# The escape a lone surrogate arrives as (raw UTF-8 surrogates already fail decoding):
# bodies without one, nearly all of them, skip the walk over their strings.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, digits
        raise OpenAIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        check_text(body)
    return body


def check_text(body: dict[str, Any]) -> None:
    """400 naming the first field (e.g. messages.0.content) whose text is not valid Unicode."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                # A key may be the culprit: escape it, the message must encode as UTF-8.
                where = ".".join(map(str, path)).encode("utf-8", "backslashreplace").decode()
                raise OpenAIError(400, f"{where}: contains a lone UTF-16 surrogate, which is not "
                                  "valid Unicode text", where.split(".")[0])
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append(((*path, key), key))  # keys reach the chat template too
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
