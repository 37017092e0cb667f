"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens over HTTP: the same tokens as
the offline engine (tests/test_token_restrictions.py referees it against HF), the truncated
prompt in usage and echo, bad values as 400s naming the field.

The harness of conftest.py: the ingress on its own server over a real engine (max_model_len 512).
"""
from __future__ import annotations

import pytest
import requests

from flagserve import LLM, SamplingParams

PROMPT = "The weather today is sunny and the"


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


def complete(url: str, **body) -> requests.Response:
    return requests.post(url + "/v1/completions", json={"model": "m", "temperature": 0,
                                                        "ignore_eos": True, **body}, timeout=60)


def test_restrictions_give_the_offline_tokens(url, llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    fields = {"allowed_token_ids": sorted(set(plain.token_ids[1:]) | {40, 41, 42}),
              "bad_words": [llm.get_tokenizer().decode(plain.token_ids[5:6])]}
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **fields),
                        use_tqdm=False)[0].outputs[0]
    assert want.token_ids != plain.token_ids
    got = complete(url, prompt=PROMPT, max_tokens=8, **fields)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.text


def test_truncated_prompt_in_usage_and_echo(url, llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    got = complete(url, prompt=PROMPT, max_tokens=2, echo=True, truncate_prompt_tokens=4,
                   truncation_side="left").json()
    assert got["usage"]["prompt_tokens"] == 4
    kept = llm.get_tokenizer().decode(ids[-4:])
    assert got["choices"][0]["text"].startswith(kept) and not got["choices"][0]["text"].startswith(PROMPT)
    # no side (vLLM's default): the tokenizer's BOS stays first, as HF's truncation keeps it
    got = complete(url, prompt=PROMPT, max_tokens=1, truncate_prompt_tokens=4, return_token_ids=True).json()
    assert got["choices"][0]["prompt_token_ids"] == ids[:1] + ids[-3:]
    # A token-id prompt past the context window fits once cut (-1: all but room for one token).
    long = list(range(10, 610))
    got = complete(url, prompt=long, max_tokens=1, truncate_prompt_tokens=-1)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens"] == 511
    right = complete(url, prompt=long, max_tokens=1, truncate_prompt_tokens=3, truncation_side="right",
                     echo=True).json()
    assert right["usage"]["prompt_tokens"] == 3
    assert right["choices"][0]["text"].startswith(llm.get_tokenizer().decode(long[:3]))


def test_chat_truncates_the_templated_prompt(url):
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 700}], "max_tokens": 1,
            "truncate_prompt_tokens": 100}
    got = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens"] == 100
    del body["truncate_prompt_tokens"]
    assert requests.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 400


@pytest.mark.parametrize("field,value", [
    ("truncate_prompt_tokens", 512), ("truncate_prompt_tokens", 0), ("truncation_side", "middle"),
    ("bad_words", [""]), ("bad_words", ["x" * 5000]), ("allowed_token_ids", []),
    ("allowed_token_ids", [10**6]),
])
def test_bad_values_name_the_field(url, field, value):
    got = complete(url, prompt=PROMPT, max_tokens=2, **{field: value})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == field, got.text


def test_unsent_max_tokens_is_a_cap_on_what_the_window_leaves(url):
    """Completions' default of 16, not sent, does not refuse a prompt cut to fit (vLLM's)."""
    got = complete(url, prompt=list(range(10, 610)), truncate_prompt_tokens=-1)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] == 1
    assert complete(url, prompt=PROMPT).json()["usage"]["completion_tokens"] == 16
    sent = complete(url, prompt=list(range(10, 610)), truncate_prompt_tokens=-1, max_tokens=16)
    assert sent.status_code == 400 and sent.json()["error"]["param"] == "max_tokens", sent.text
