"""The official `openai` client on tool calling, against the ingress over the tiny model:
tool_choice required and a named function, streamed and not, and a two-turn conversation
(the call's result fed back as a tool message, the model answers in text)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.conftest import serving
from tests.api.test_tools_api import NAMED, SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "Pick a color and set the flag."}]


@pytest.fixture(scope="module")
def client(llama_path):
    with serving(llama_path, "thread") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_parse(client, choice):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=120, temperature=0.8, seed=1)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == ("stop" if choice == NAMED else "tool_calls") and message.tool_calls
    for call in message.tool_calls:
        valid(call.function.name, call.function.arguments)
    if choice == NAMED:
        assert [c.function.name for c in message.tool_calls] == ["pick"]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_forced_calls_join_into_valid_calls(client, choice):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=120, temperature=0.8, seed=2, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += (delta.function and delta.function.name) or ""
            call["arguments"] += (delta.function and delta.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == ("stop" if choice == NAMED else "tool_calls") and calls
    for call in calls.values():
        valid(call["name"], call["arguments"])


def test_a_two_turn_tool_conversation(client):
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED, max_tokens=60)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages = [*ASK, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"done": true}'}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=8)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    # The tool's result reached the prompt: more prompt tokens than the first turn's.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
