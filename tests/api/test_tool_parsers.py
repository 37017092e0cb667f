"""Tool calling's pieces without a server: the Hermes parser (whole, streamed, malformed), the
parser registry, a choice's output -> content + tool_calls, and the follow-up turn rendered
by a tools-aware chat template."""
from __future__ import annotations

import json
from typing import get_args

import pytest

from flagserve.entrypoints.openai.template_input import template_message
from flagserve.entrypoints.openai.tokenizer import ChatOptions, PromptTokenizer
from flagserve.entrypoints.openai.tool_output import ToolOutput, full_message, stream_step
from flagserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, HermesParser, ParsedCall, choose_parser

TWO = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
       '<tool_call>{"name": "time", "arguments": {"tz": "CET"}}</tool_call>')


def parse(text: str, piece: int | None = None) -> list:
    p, events = HermesParser(), []
    for i in range(0, len(text), piece or len(text) or 1):
        events += p.feed(text[i:i + (piece or len(text))])
    events += p.finish()
    merged: list = []  # adjacent text joined, as a client would
    for e in events:
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        else:
            merged.append(e)
    return merged


@pytest.mark.parametrize("piece", [None, 1, 3, 7])
def test_hermes_finds_every_call_however_the_text_arrives(piece):
    assert parse(TWO, piece) == ["Let me check. ", ParsedCall("weather", '{"city": "Paris"}'), "\n",
                                 ParsedCall("time", '{"tz": "CET"}')]


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call> ok",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "<tool_call>{\"name\": \"f\", \"argu",  # cut short
    "a < b and <tool_ca",  # a partial tag at the end is text after all
])
def test_malformed_calls_stay_plain_content(text):
    assert parse(text, 2) == [text]


def test_an_unclosed_call_with_whole_json_counts():
    assert parse('<tool_call>{"name": "f", "arguments": {"x": 1}}') == [ParsedCall("f", '{"x": 1}')]


def test_string_arguments_are_normalized_to_a_json_object():
    assert parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [
        ParsedCall("f", '{"x": 1}')]


def test_the_config_type_names_every_parser_of_the_registry():
    from flagserve.config.schema import ToolCallParser
    assert set(get_args(ToolCallParser)) == {"auto", *TOOL_PARSERS}


def test_the_registry():
    assert choose_parser("auto", "...<tool_call>...") is HermesParser
    assert choose_parser("hermes", None) is HermesParser
    with pytest.raises(ValueError, match="tool_call_parser 'nope' is not one of: auto, hermes"):
        choose_parser("nope", None)


def test_auto_output_becomes_content_and_tool_calls():
    message = full_message(ToolOutput("auto", HermesParser), TWO)
    assert message["content"] == "Let me check. \n"
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "weather", {"city": "Paris"}), ("function", "time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    plain = full_message(ToolOutput("auto", HermesParser), "Just text.")
    assert plain == {"role": "assistant", "content": "Just text."}
    # parallel_tool_calls: false keeps the first call alone (vLLM's filter)
    first = full_message(ToolOutput("auto", HermesParser, parallel=False), TWO)["tool_calls"]
    assert [c["function"]["name"] for c in first] == ["weather"]


def test_streamed_deltas_index_calls_and_hold_them_until_whole():
    out, deltas = ToolOutput("auto", HermesParser), []
    for i in range(0, len(TWO), 5):
        deltas.append(stream_step(out, TWO[i:i + 5], None)[0])
    last, reason = stream_step(out, "", "stop")
    calls = [c for d in [*deltas, last] for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "weather"), (1, "time")]
    assert all(json.loads(c["function"]["arguments"]) for c in calls) and reason == "tool_calls"


def test_required_and_named_outputs():
    required = full_message(ToolOutput("required"), '[{"name": "f", "arguments": {"a": 1}}]')
    assert required["content"] is None and required["tool_calls"][0]["function"] == {
        "name": "f", "arguments": '{"a": 1}'}
    out = ToolOutput("named", named="g")
    first, _ = stream_step(out, '{"a"', None)
    rest, reason = stream_step(out, ': 2}', "stop")
    assert first["tool_calls"][0]["function"] == {"name": "g", "arguments": '{"a"'}
    assert rest["tool_calls"] == [{"index": 0, "function": {"arguments": ": 2}"}}] and reason == "stop"
    cut = ToolOutput("required")
    short = '[{"name": "f", "argu'
    assert full_message(cut, short) == {"role": "assistant", "content": short}
    assert cut.finish_reason("length") == "length"


# Enough of Qwen2.5's template to show tools and earlier calls.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}</{{ m.role }}>{% endfor %}")


def test_the_follow_up_turn_reaches_a_tools_template(llama_path):
    tok = PromptTokenizer(llama_path)
    tok.tokenizer.chat_template = TOOLS_TEMPLATE
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [call]},  # content null: dropped by the ingress
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "weather"}}]
    ids = tok.encode_chat([template_message(m) for m in messages],
                         ChatOptions(False, template_kwargs={"tools": tools}))
    text = tok.tokenizer.decode(ids)
    assert text == ('TOOLS:weather;<user>Weather?</user><assistant><tool_call>weather {"city": "Paris"}'
                    "</tool_call></assistant><tool>sunny</tool>")


def test_a_template_blind_to_tools_gets_them_in_the_system_message(llama_path):
    # The tiny llama's template ignores `tools`: they go into the system message, in the
    # Hermes format the default parser reads, and the caller's system text stays first.
    tok = PromptTokenizer(llama_path)
    assert not tok.template_shows_tools()
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    for messages in ([{"role": "user", "content": "Weather?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]):
        described = ChatOptions(template_kwargs={"tools": tools}, describe_tools=True)
        text = tok.tokenizer.decode(tok.encode_chat(messages, described))
        assert '<tools>\n{"type": "function", "function": {"name": "weather"' in text
        assert "<tool_call>" in text and text.count("Weather?") == 1
        assert ("Be brief.\n\n# Tools" in text) == (len(messages) == 2)
        plain = tok.tokenizer.decode(tok.encode_chat(messages, ChatOptions(template_kwargs={"tools": tools})))
        assert "<tools>" not in plain  # required / named: the grammar writes the call
    shown = PromptTokenizer(llama_path)
    shown.tokenizer.chat_template = TOOLS_TEMPLATE
    assert shown.template_shows_tools()
    text = shown.tokenizer.decode(shown.encode_chat([{"role": "user", "content": "Hi"}], ChatOptions(
        False, template_kwargs={"tools": tools}, describe_tools=True)))
    assert text == "TOOLS:weather;<user>Hi</user>"


PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]


@pytest.mark.parametrize("template, text", [
    # concatenates content: a list would fail (SmolLM2's) or be written as its repr
    ("{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}", "<user>Hi\nthere"),
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", "<user>Hi\nthere"),
    # takes parts (Qwen3's way): they reach it as sent
    ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
     "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "<user>Hithere"),
])
def test_text_parts_reach_the_template_as_it_takes_them(llama_path, template, text):
    """vLLM's content formats: parts joined by newlines for a template that takes strings."""
    tok = PromptTokenizer(llama_path)
    tok.tokenizer.chat_template = template
    assert tok.tokenizer.decode(tok.encode_chat(PARTS, ChatOptions(False))) == text
