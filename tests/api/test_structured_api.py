"""Structured outputs over HTTP: `response_format` (json_object, json_schema) and vLLM's
`structured_outputs` on chat and completions, 400s naming the field, and the official
`openai` client's `parse()` against the real model.

The ingress on its own uvicorn server over a real engine, no Ray: the tiny model on a thread
for the field checks, SmolLM2 in an engine child process (the params are pickled there and
the grammar compiled there) for parse().
"""
from __future__ import annotations

import json
import re

import pydantic
import pytest
import requests

from flagserve.models.packaged import smollm2_gguf
from tests.api.conftest import serving

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


def post(url: str, route: str, **body) -> requests.Response:
    return requests.post(url + route, json={"max_tokens": 40, "temperature": 0, **body}, timeout=60)


def chat(url: str, **body) -> requests.Response:
    return post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], **body)


def test_json_schema_on_chat_and_completions(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}}
    r = chat(url, response_format=fmt)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    r = post(url, "/v1/completions", prompt="Say", n=2, temperature=1.0, seed=3, response_format=fmt)
    assert [json.loads(c["text"]) in ({"ok": True}, {"ok": False}) for c in r.json()["choices"]] == [True] * 2


def test_vllm_structured_outputs_field(url):
    r = chat(url, structured_outputs={"choice": ["red", "green"]}, n=3, temperature=1.0)
    assert {c["message"]["content"] for c in r.json()["choices"]} <= {"red", "green"}
    r = post(url, "/v1/completions", prompt="Code:", structured_outputs={"regex": r"[A-Z]{3}-\d{2}"})
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.json()["choices"][0]["text"])
    r = chat(url, structured_outputs={"grammar": 'root ::= "a" | "b"'}, stream=True)
    events = [line for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events) in "ab"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(url, body, param):
    for r in (chat(url, **body), post(url, "/v1/completions", prompt="x", **body)):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


class Capital(pydantic.BaseModel):
    country: str
    capital: str


def test_openai_client_parse_against_smollm2():
    from openai import OpenAI
    with serving(str(smollm2_gguf()), "process") as u:
        client = OpenAI(base_url=u + "/v1", api_key="none")
        done = client.chat.completions.parse(
            model="m", response_format=Capital, temperature=0, max_tokens=48,
            messages=[{"role": "user", "content": "What is the capital of France? "
                                                  "Answer in JSON with the keys country and capital."}])
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital) and done.choices[0].finish_reason == "stop"
    assert parsed.capital == "Paris", parsed
