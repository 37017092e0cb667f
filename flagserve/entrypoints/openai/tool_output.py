"""A chat choice's output text -> OpenAI's `content` and `tool_calls`, streamed or whole.

One ToolOutput per choice; feed() takes each text delta and returns the message delta to
send (content and/or tool-call deltas), finish() what is left at the end. A whole response is
the same deltas, merged (full_message), so the streamed and the whole answer agree.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from flagserve.entrypoints.openai.tool_parsers import ParsedCall
from flagserve.entrypoints.openai.tools import ToolMode


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolOutput:
    def __init__(self, mode: ToolMode, parser: Any = None, named: str | None = None,
                 parallel: bool = True):
        """`parallel`: the request's parallel_tool_calls; False keeps the first call alone
        (`required` is held to one by its grammar, `auto` drops the model's later calls)."""
        self.mode, self.named, self.parallel = mode, named, parallel
        self.parser = parser() if mode == "auto" else None
        self.calls = 0  # calls sent so far: the next one's index
        self.text = ""  # `required`: the JSON list, parsed at the end

    def feed(self, text: str) -> dict[str, Any]:
        if self.mode == "auto":
            return self._events(self.parser.feed(text))
        if self.mode == "required":
            self.text += text
            return {}
        if self.mode == "named":  # the arguments stream as they come: the grammar keeps them whole
            if not text:
                return {}
            start = {} if self.calls else {"id": call_id(), "type": "function"}
            fn = {"arguments": text} if self.calls else {"name": self.named, "arguments": text}
            self.calls = 1
            return {"tool_calls": [{"index": 0, **start, "function": fn}]}
        return {"content": text} if text else {}

    def finish(self) -> dict[str, Any]:
        if self.mode == "auto":
            return self._events(self.parser.finish())
        if self.mode == "required":
            return self._events(required_calls(self.text))
        return {}

    def _events(self, events: list[str | ParsedCall]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        for e in events:
            if isinstance(e, str):
                delta["content"] = delta.get("content", "") + e
                continue
            if self.calls and not self.parallel:
                continue
            delta.setdefault("tool_calls", []).append(
                {"index": self.calls, "id": call_id(), "type": "function",
                 "function": {"name": e.name, "arguments": e.arguments}})
            self.calls += 1
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" where the model chose to call; a named function was the caller's
        choice, and ends "stop" (OpenAI's and vLLM's)."""
        return "tool_calls" if reason == "stop" and self.calls and self.mode != "named" else reason


def required_calls(text: str) -> list[str | ParsedCall]:
    """`required`'s JSON list of calls; text cut short (max_tokens) stays text."""
    try:
        calls = json.loads(text)
    except ValueError:
        return [text] if text else []
    return [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def full_message(out: ToolOutput, text: str) -> dict[str, Any]:
    """The whole message: content outside the calls (null when there is none), tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: list[dict[str, Any]] = []
    content = ""
    for delta in (out.feed(text), out.finish()):
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls.append({k: v for k, v in call.items() if k != "index"})
            else:  # more of the last call's arguments
                calls[-1]["function"]["arguments"] += call["function"]["arguments"]
    if content.strip() or not calls:
        message["content"] = content
    if calls:
        message["tool_calls"] = calls
    return message


def stream_step(out: ToolOutput, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """One streamed delta of a choice: what its text settles, and at its end what is left."""
    delta = out.feed(text)
    if reason is not None:
        end = out.finish()
        if "content" in end:
            delta["content"] = delta.get("content", "") + end["content"]
        if "tool_calls" in end:
            delta.setdefault("tool_calls", []).extend(end["tool_calls"])
    return delta, out.finish_reason(reason)
