"""Messages as chat templates take them: earlier turns' tool calls with their arguments as
objects, text parts as one string for templates that take strings, and the tools described
in the system message for templates that do not show `tools` (SmolLM2's, Llama 2's), so that
tool_choice `auto` still lets the model know them. No pydantic here: the offline LLM imports
this, on images without the server's packages too (the lent GPU machine's)."""
from __future__ import annotations

import contextlib
import json
from typing import Any


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier turn as chat templates expect it: the arguments of an assistant's tool calls
    as objects (OpenAI sends JSON text; templates write them with tojson, as vLLM passes them),
    and content "" rather than null (templates concatenate it)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text as sent
                fn = {**fn, "arguments": json.loads(fn["arguments"])}
            call = {**call, "function": fn}
        fixed.append(call)
    return {**message, "content": message.get("content") or "", "tool_calls": fixed}


def joined_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is text parts, with the parts' text as one string (vLLM's
    "string" content format: joined by newlines)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                         ) -> list[dict[str, Any]]:
    """The tools described in the system message (Qwen2.5's Hermes wording), for templates
    that do not show them: appended to the caller's system message, or one of its own. Such
    a template drops earlier turns' tool_calls too: they go into their content in the form the
    prompt asks for, so the model sees the calls its tool results answer."""
    prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    messages = [_calls_as_text(m) for m in messages]
    system = messages[0] if messages and messages[0].get("role") == "system" else None
    content = system.get("content") if system is not None else None
    if isinstance(content, str):
        return [{**system, "content": f"{content}\n\n{prompt}"}, *messages[1:]]
    if isinstance(content, list):  # text parts (a template that takes them)
        return [{**system, "content": [*content, {"type": "text", "text": f"\n\n{prompt}"}]},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    texts = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            call_json = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                   ensure_ascii=False)
            texts.append(f"<tool_call>\n{call_json}\n</tool_call>")
    content = message.get("content") or ""
    text = "\n".join([content, *texts] if content else texts)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
