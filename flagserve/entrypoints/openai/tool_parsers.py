"""Tool-call parsers for tool_choice "auto": the model writes its calls in its own markup, and a
parser per model family finds them in the output text (vLLM's --tool-call-parser).

A registry, name -> parser class, so a family is added by one class and one line. The server
picks one per model (serve.<id>.tool_call_parser; `auto`: the first whose markup appears in
the model's chat template, else hermes, the ChatML families' format).

Parsers are incremental: feed() takes the text as it streams and returns what is settled
(text outside any call, or a whole call); a call's text is held until it is complete, so a
stream sends each call as one delta with arguments that parse.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


Event = str | ParsedCall  # text outside the calls, or one call


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_call(body: str) -> ParsedCall | None:
    """{"name": ..., "arguments": {...}} -> a call; None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Hermes 2 Pro / Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.START in chat_template

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            tag = self.END if self.inside else self.START
            at = self.buf.find(tag)
            if at < 0:
                if not self.inside:  # text outside a call is settled, but for a partial tag
                    keep = len(self.buf) - _held(self.buf, tag)
                    out.append(self.buf[:keep])
                    self.buf = self.buf[keep:]
                return [e for e in out if e != ""]
            body, self.buf = self.buf[:at], self.buf[at + len(tag):]
            out.append(body if not self.inside else self._call(body))
            self.inside = not self.inside

    def finish(self) -> list[Event]:
        """The end of the output: an unclosed call counts if its JSON is whole."""
        rest, self.buf = self.buf, ""
        if not self.inside:
            return [rest] if rest else []
        self.inside = False
        call = json_call(rest.strip())
        return [call] if call is not None else [self.START + rest]

    def _call(self, body: str) -> Event:
        call = json_call(body.strip())
        # Malformed markup stays the model's text: nothing is lost, nothing is invented.
        return call if call is not None else self.START + body + self.END


TOOL_PARSERS: dict[str, Any] = {"hermes": HermesParser}
DEFAULT_PARSER = "hermes"


def choose_parser(name: str, chat_template: str | None) -> Any:
    """The parser class for serve.<id>.tool_call_parser; ValueError for an unknown name."""
    if name == "auto":
        found = [p for p in TOOL_PARSERS.values() if p.detect(chat_template or "")]
        return found[0] if found else TOOL_PARSERS[DEFAULT_PARSER]
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is not one of: auto, {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
