"""Tool calling over HTTP: tool_choice required / a named function (constrained: the arguments
parse and match the schema), none, auto (parsed from the output), streamed tool-call deltas,
the follow-up turn, 400s naming the field, and the official `openai` client against SmolLM2.

The harness of conftest.py: the ingress on its own server over a real engine.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from flagserve.models.packaged import smollm2_gguf
from tests.api.conftest import serving
from tests.api.test_structured_api import FLAG, chat, post

PICK = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "flag", "description": "Set the flag", "parameters": FLAG}},
         {"type": "function", "function": {"name": "pick", "parameters": PICK}}]
SCHEMAS = {"flag": FLAG, "pick": PICK}
NAMED = {"type": "function", "function": {"name": "pick"}}


def checked_calls(choice: dict, finish: str = "tool_calls") -> list[dict]:
    """The choice's tool calls, each one's arguments parsed and valid against its function.
    `finish`: "stop" for a named function, the caller's choice (OpenAI's and vLLM's)."""
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_"), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert choice["finish_reason"] == finish, choice
    return calls


def test_required_makes_valid_calls(url):
    r = chat(url, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0,
             seed=1, max_tokens=60)
    for choice in r.json()["choices"]:
        assert len(checked_calls(choice)) == 1 and choice["message"]["content"] is None


def test_required_takes_parameters_that_refer_to_their_own_defs(url):
    """pydantic's nested models: {"$ref": "#/$defs/Loc"} in a function's parameters, which
    under `required` sit inside the list of calls (the references follow them there)."""
    loc = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
    weather = {"type": "object", "$defs": {"Loc": loc},
               "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
               "additionalProperties": False}
    tools = [*TOOLS, {"type": "function", "function": {"name": "weather", "parameters": weather}}]
    r = chat(url, tools=tools, tool_choice="required", n=2, temperature=1.0, seed=2,
             max_tokens=80)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        for call in choice["message"]["tool_calls"]:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                weather if name == "weather" else SCHEMAS[name])


def test_a_named_function_is_the_call(url):
    r = chat(url, tools=TOOLS, tool_choice=NAMED)
    assert [c["function"]["name"] for c in checked_calls(r.json()["choices"][0], "stop")] == ["pick"]


@pytest.mark.parametrize("parameters", [{}, {"description": "no arguments"}], ids=["empty", "no-type"])
def test_parameters_without_a_type_take_an_object(url, parameters):
    """`{}` or a schema without a type admits any JSON value: a call's arguments are an object
    all the same (vLLM's and OpenAI's reading). Sampled, several choices."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = chat(url, tools=tools, tool_choice=choice, n=4, temperature=1.0, seed=7, max_tokens=40)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            for call in c["message"].get("tool_calls") or []:
                assert isinstance(json.loads(call["function"]["arguments"]), dict), call


def test_none_answers_in_text(url):
    r = chat(url, tools=TOOLS, tool_choice="none", max_tokens=8)
    choice = r.json()["choices"][0]
    assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")


def events(r) -> list[dict]:
    return [json.loads(line[6:])["choices"] for line in r.text.splitlines() if line.startswith("data: {")]


def test_streamed_named_call_arrives_in_pieces_that_join(url):
    r = chat(url, tools=TOOLS, tool_choice=NAMED, stream=True)
    deltas = [c[0]["delta"].get("tool_calls") for c in events(r) if c]
    pieces = [d[0] for d in deltas if d]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "pick"
    assert {p["index"] for p in pieces} == {0} and all("id" not in p for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p["function"]["arguments"] for p in pieces)), PICK)
    assert [c[0]["finish_reason"] for c in events(r) if c][-1] == "stop"


def test_streamed_choices_end_once_with_their_own_calls(url):
    """n choices that end apart: each choice's calls and finish arrive once (a finished choice
    is not repeated in later events)."""
    r = chat(url, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3,
             temperature=1.0, seed=3, max_tokens=60, stream=True)
    choices = [c for e in events(r) for c in e]
    for index in range(3):
        mine = [c for c in choices if c["index"] == index]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["tool_calls"], mine
        calls = [t for c in mine for t in c["delta"].get("tool_calls", [])]
        assert len(calls) == 1 and calls[0]["index"] == 0, calls


# The tiny model's random weights never write <tool_call> of themselves: a grammar makes them,
# so that `auto` is tested through the engine, the parser and the stream.
FORCED = {"regex": r'Hi <tool_call>\{"name": "flag", "arguments": \{"ok": (true|false)\}\}</tool_call>'}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_calls_out_of_the_text(url, stream):
    # One tool: the tiny model's template ignores tools, so auto describes them in the system
    # message (~350 of its 512 tokens for one).
    r = chat(url, tools=TOOLS[:1], tool_choice="auto", structured_outputs=FORCED, stream=stream,
             max_tokens=60)
    if not stream:
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "Hi " and len(checked_calls(choice)) == 1
        return
    chunks = [c[0] for c in events(r) if c]
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Hi "
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "flag"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), FLAG)
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_the_follow_up_turn_is_accepted_and_rendered(url):
    first = chat(url, tools=TOOLS, tool_choice=NAMED).json()["choices"][0]["message"]
    turn = [{"role": "user", "content": "Pick one"}, first]
    answer = [{"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "blue is set"}]
    # `pick` alone: the tiny model's 512 tokens hold the tool prompt of one
    without = post(url, "/v1/chat/completions", tools=TOOLS[1:], messages=turn, max_tokens=4)
    r = post(url, "/v1/chat/completions", tools=TOOLS[1:], messages=turn + answer, max_tokens=4)
    assert r.status_code == without.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"]
    # The tiny model's template drops tool_calls (as SmolLM2's does): the call is written
    # into the assistant turn as the system message's tool prompt asks for it.
    ids = requests.post(url + "/tokenize", json={"messages": turn + answer, "tools": TOOLS[1:]},
                        timeout=60).json()["tokens"]
    prompt = requests.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    call = first["tool_calls"][0]["function"]
    assert f'<tool_call>\n{{"name": "pick", "arguments": {call["arguments"]}}}\n</tool_call>' \
        in prompt, prompt


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]},
     "tools"),  # auto: the model may call it, and the client parses by that schema
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools"),  # arguments are an object (OpenAI's rule)
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(url, body, param):
    r = chat(url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_openai_client_gets_a_parsable_call_from_smollm2():
    from openai import OpenAI
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": weather}}
    with serving(str(smollm2_gguf()), "process") as u:
        done = OpenAI(base_url=u + "/v1", api_key="none").chat.completions.create(
            model="m", tools=[tool], tool_choice="required", parallel_tool_calls=False, temperature=0,
            max_tokens=48, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = done.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)


def test_streamed_token_ids_of_held_calls_join_into_the_whole_answers(url):
    """return_token_ids while `required` holds its calls until they are whole: every token's
    id is sent all the same."""
    body = dict(tools=TOOLS, tool_choice="required", max_tokens=30, seed=1, temperature=1.0,
                return_token_ids=True)
    whole = chat(url, **body).json()["choices"][0]
    streamed = [c for e in events(chat(url, **body, stream=True)) for c in e]
    assert [t for c in streamed for t in c.get("token_ids", [])] == whole["token_ids"]
    assert len(whole["token_ids"]) > 1
