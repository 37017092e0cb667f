"""Fields FlagServe cannot honour are 400s naming them, never silently ignored; fields that do
not change the output are accepted; what the official client sends for its ordinary calls
(captured off the wire) always parses."""
from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

from flagserve.entrypoints.openai.checks import check_chat, check_completion
from flagserve.entrypoints.openai.errors import OpenAIError
from flagserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT, COMPLETION = (ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "hi"})

REFUSED = [  # request, extra fields, the param named, a word of the message
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions", "use tools"),
    (CHAT, {"function_call": "auto"}, "function_call", "tool_choice"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "text modality"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted"),
    (CHAT, {"web_search_options": {}}, "web_search_options", "not supported"),
    (CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort", "Input should be"),
    (CHAT, {"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    (CHAT, {"verbosity": "low"}, "verbosity", "not supported"),
    (CHAT, {"guided_json": {"type": "object"}}, "guided_json", "structured_outputs.json"),
    (CHAT, {"frobnicate": 1}, "frobnicate", "unknown field"),
    (CHAT, {"stream_options": {"include_usage": True, "extra": 1}}, "stream_options", "unknown"),
    (COMPLETION, {"guided_regex": "a+"}, "guided_regex", "structured_outputs.regex"),
    (COMPLETION, {"functions": []}, "functions", "unknown field"),  # not a completions field
    (COMPLETION, {"max_new_tokens": 3}, "max_new_tokens", "max_tokens"),
    # unknown keys inside the fields' objects too
    (CHAT, {"response_format": {"type": "json_object", "schema": {}}}, "response_format", "unknown"),
    (CHAT, {"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format",
     "only with type 'json_schema'"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "foo": 1}}},
     "response_format", "unknown"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools", "unknown"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}},
     "tool_choice", "unknown"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
     "messages", "unknown"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages", "'image_url' are not supported"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools",
     "two functions are named 'f'"),
    # numbers as JSON numbers: a string or a boolean is not taken for one
    (COMPLETION, {"temperature": "0.5"}, "temperature", "valid number"),
    (CHAT, {"top_p": True}, "top_p", "valid number"),
    (CHAT, {"logit_bias": {"5": "1"}}, "logit_bias", "valid number"),
    (COMPLETION, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "valid boolean"),
    (CHAT, {"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options",
     "valid boolean"),
]


@pytest.mark.parametrize("request_,extra,param,word", REFUSED, ids=[r[2] for r in REFUSED])
def test_fields_that_cannot_be_honoured_are_400_naming_them(request_, extra, param, word):
    model, base = request_
    with pytest.raises(OpenAIError) as err:
        parse_request(model, {**base, **extra})
    assert (err.value.status, err.value.param) == (400, param)
    assert word in err.value.message


ACCEPTED = [  # they label or route the request on OpenAI's side; the output is the same
    (CHAT, {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s"}),
    (CHAT, {"logit_bias": None, "functions": None, "audio": None, "modalities": ["text"]}),
    (CHAT, {"logit_bias": {}}),  # asks for no bias
    (COMPLETION, {"user": "u1", "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("request_,extra", ACCEPTED)
def test_output_neutral_fields_are_accepted(request_, extra):
    model, base = request_
    parse_request(model, {**base, **extra})


NULLS = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None,
         "ignore_eos": None, "skip_special_tokens": None, "min_tokens": None,
         "stream_options": {"include_usage": True, "include_obfuscation": None}}


@pytest.mark.parametrize("request_,extra", [
    (CHAT, {**NULLS, "logprobs": None, "parallel_tool_calls": None, "top_logprobs": None}),
    (COMPLETION, {**NULLS, "echo": None, "logprobs": None})], ids=["chat", "completion"])
def test_null_reads_as_the_default(request_, extra):
    """OpenAI's optional fields are nullable; the client sends null for an argument of None."""
    model, base = request_
    got, plain = parse_request(model, {**base, **extra}), parse_request(model, base)
    for field in extra:
        if field != "stream_options":
            assert getattr(got, field) == getattr(plain, field), field
    with pytest.raises(OpenAIError) as err:  # a required field stays required
        parse_request(model, {**base, next(iter(base)): None})
    assert err.value.param == next(iter(base))


def test_top_logprobs_0_asks_for_nothing():
    assert check_chat(parse_request(ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 0})) is None


def test_stream_options_need_stream():
    """vLLM's rule: stream_options without stream would be unused."""
    for model, base in (CHAT, COMPLETION):
        check = check_completion if model is CompletionRequest else check_chat
        options = {"stream_options": {"include_usage": True}}
        with pytest.raises(OpenAIError) as err:
            check(parse_request(model, {**base, **options}))
        assert (err.value.status, err.value.param) == (400, "stream_options")
        check(parse_request(model, {**base, **options, "stream": True}))


def _sent_bodies(call) -> list[dict]:
    """The JSON bodies the official client sends for `call(client)`, answered with a stub."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(500, json={"error": {"message": "stub"}})

    client = openai.OpenAI(base_url="http://stub/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with pytest.raises(openai.InternalServerError):
        call(client)
    return bodies


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CLIENT_CALLS = [
    (ChatCompletionRequest, lambda c: c.chat.completions.create(
        model="m", messages=MESSAGES, max_completion_tokens=5, temperature=0.5, top_p=0.9, n=1,
        stop=["x"], seed=1, presence_penalty=0.1, frequency_penalty=0.1, logprobs=True,
        top_logprobs=2, user="u", metadata={"a": "b"}, store=False, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 5, "min_p": 0.1, "prompt_logprobs": 1})),
    (ChatCompletionRequest, lambda c: c.chat.completions.parse(
        model="m", messages=MESSAGES, response_format={"type": "json_object"})),
    (CompletionRequest, lambda c: c.completions.create(
        model="m", prompt="hi", max_tokens=3, logprobs=2, echo=True, stop="x", seed=2, user="u")),
]


@pytest.mark.parametrize("model,call", CLIENT_CALLS)
def test_what_the_official_client_sends_parses(model, call):
    (body,) = _sent_bodies(call)
    parse_request(model, body)


COMPLETION_REFUSED = [({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
                      ({"best_of": 0}, "best_of"), ({"n": 2, "best_of": 1}, "best_of")]


@pytest.mark.parametrize("extra,param", COMPLETION_REFUSED, ids=[str(r[0]) for r in COMPLETION_REFUSED])
def test_completion_fields_that_cannot_be_honoured_are_400_naming_them(extra, param):
    req = parse_request(CompletionRequest, {"prompt": "hi", **extra})
    with pytest.raises(OpenAIError) as err:
        check_completion(req)
    assert (err.value.status, err.value.param) == (400, param)


def test_best_of_equal_to_n_and_echo_are_served():
    for extra in ({"best_of": 1}, {"n": 3, "best_of": 3}, {"echo": False, "suffix": "", "logit_bias": {}},
                  {"echo": True, "logprobs": 1, "prompt_logprobs": 2}):
        check_completion(parse_request(CompletionRequest, {"prompt": "hi", **extra}))


def test_null_stays_null_where_the_field_holds_it():
    """Completions' `max_tokens: null` asks for what the context leaves (vLLM's), not 16."""
    assert parse_request(CompletionRequest, {"prompt": "hi", "max_tokens": None}).max_tokens is None
    assert parse_request(CompletionRequest, {"prompt": "hi"}).max_tokens == 16
