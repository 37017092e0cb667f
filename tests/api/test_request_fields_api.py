"""Request fields and routes as OpenAI's and vLLM's clients use them: models.retrieve, errors
naming the field the client sent.

The harness of conftest.py: the ingress on its own server over a real engine.
"""
from __future__ import annotations

import requests

from tests.api.test_structured_api import chat


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
