"""Request fields and routes as OpenAI's and vLLM's clients use them: models.retrieve, errors
naming the field the client sent, vLLM's request_id, add_special_tokens,
continue_final_message, reasoning_effort.

The harness of conftest.py: the ingress on its own server over a real engine.
"""
from __future__ import annotations

import json

import requests
from transformers import AutoTokenizer

from flagserve.entrypoints.openai.protocol import ChatCompletionRequest, parse_request
from tests.api.test_structured_api import chat, post


def test_models_retrieve_gives_the_card_of_one_model(url):
    listed = requests.get(url + "/v1/models", timeout=10).json()["data"][0]
    got = requests.get(url + "/v1/models/m", timeout=10)
    assert got.status_code == 200 and got.json() == listed
    missing = requests.get(url + "/v1/models/other/name", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_an_out_of_range_max_completion_tokens_is_named_as_sent(url):
    for field in ("max_completion_tokens", "max_tokens"):
        r = chat(url, **{"max_tokens": None, field: 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert r.json()["error"]["message"].startswith(field), r.text


def test_request_id_names_the_response(url):
    r = chat(url, request_id="trace-7", max_tokens=2)
    assert r.json()["id"] == "chatcmpl-trace-7"
    r = requests.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "request_id": "trace-7",
                                                     "stream": True}, timeout=60)
    ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
    assert ids == {"cmpl-trace-7"}
    # the same id twice at once is no conflict: the engine's ids are its own
    assert chat(url, request_id="trace-7", max_tokens=2).status_code == 200


def test_add_special_tokens_on_completions(url, llama_path):
    tok = AutoTokenizer.from_pretrained(llama_path)
    with_bos, without = tok.encode("Hi there"), tok.encode("Hi there", add_special_tokens=False)
    assert len(with_bos) == len(without) + 1  # the tiny tokenizer writes BOS
    for flag, ids in ((True, with_bos), (False, without)):
        r = requests.post(url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 1,
                                                         "add_special_tokens": flag}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(ids), r.text


def test_continue_final_message_leaves_the_last_turn_open(url):
    messages = [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "The color is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = requests.post(url + "/tokenize", json=body, timeout=10).json()["tokens"]
    text = requests.post(url + "/detokenize", json={"tokens": tokens}, timeout=10).json()["prompt"]
    assert text.endswith("The color is"), text
    closed = requests.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                           timeout=10).json()["tokens"]
    assert closed[:len(tokens)] == tokens and len(closed) > len(tokens)
    r = post(url, "/v1/chat/completions", **body, max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens), r.text


def test_reasoning_effort_is_a_template_variable():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    opts = parse_request(ChatCompletionRequest, {**base, "reasoning_effort": "low"}).chat_options()
    assert opts.template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    none = parse_request(ChatCompletionRequest, {**base, "reasoning_effort": "none"}).chat_options()
    assert none.template_kwargs["enable_thinking"] is False
    theirs = parse_request(ChatCompletionRequest, {**base, "reasoning_effort": "high",
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert theirs.chat_options().template_kwargs["enable_thinking"] is False  # the caller's own wins


def events(r: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_return_token_ids_gives_the_prompt_and_the_output_ids(url):
    """vLLM's return_token_ids: the prompt as the server tokenized it, each choice's tokens
    (their count is the usage's), the same streamed and whole."""
    prompt = requests.post(url + "/tokenize", json={"prompt": "Hi there"}, timeout=10).json()["tokens"]
    body = {"prompt": "Hi there", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_token_ids": True}
    whole = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [prompt, prompt]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"] == 12
    chunks = [c for e in events(requests.post(url + "/v1/completions", json={**body, "stream": True},
                                              timeout=60)) for c in e["choices"]]
    for choice in whole["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    templated = requests.post(url + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    chat_body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                 "return_token_ids": True}
    got = requests.post(url + "/v1/chat/completions", json=chat_body, timeout=60).json()
    assert got["prompt_token_ids"] == templated and len(got["choices"][0]["token_ids"]) == 4
    streamed = events(requests.post(url + "/v1/chat/completions", json={**chat_body, "stream": True},
                                    timeout=60))
    assert streamed[0]["prompt_token_ids"] == templated
    assert [t for e in streamed for c in e["choices"] for t in c.get("token_ids", [])] \
        == got["choices"][0]["token_ids"]
    plain = requests.post(url + "/v1/chat/completions", json={**chat_body, "return_token_ids": False},
                          timeout=60).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_chat_echo_returns_the_prefill_with_its_continuation(url):
    """vLLM's chat echo: the last message's text first where it is the assistant's."""
    messages = [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "The color is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(url, "/v1/chat/completions", **body).json()["choices"][0]["message"]["content"]
    echoed = post(url, "/v1/chat/completions", **body, echo=True).json()["choices"][0]["message"]["content"]
    assert echoed == "The color is" + plain
    streamed = events(requests.post(url + "/v1/chat/completions", json={**body, "echo": True, "stream": True},
                                    timeout=60))
    assert "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"]) == echoed
    # the last message a user's: nothing to echo
    asked = {**body, "messages": messages[:1], "add_generation_prompt": True, "continue_final_message": False}
    assert post(url, "/v1/chat/completions", **asked, echo=True).json()["choices"][0]["message"]["content"] \
        == post(url, "/v1/chat/completions", **asked).json()["choices"][0]["message"]["content"]


def test_priority_needs_the_engines_priority_policy(url):
    """This server's engine schedules first come, first served: only 0, as vLLM's."""
    assert chat(url, priority=0, max_tokens=1).status_code == 200
    r = chat(url, priority=3, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "scheduling_policy 'priority'" in r.json()["error"]["message"]
