"""Scoring prompts over HTTP, as lm-evaluation-harness's `local-completions` does for
loglikelihood (echo, logprobs 1, max_tokens 1, a batch of token-id prompts): the prompt
tokens' logprobs against HF transformers on the same model, and the greedy check; chat's
top-level `prompt_logprobs`.

The harness of conftest.py: the ingress on its own server over a real engine
(the tiny model, float32 as its checkpoint, on a thread).
"""
from __future__ import annotations

import json

import pytest
import requests
import torch

from tests.api.test_echo_units import lm_eval_reading

CONTEXT = 4  # prompt tokens before the continuation that is scored


@pytest.fixture(scope="module")
def hf(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_path)


@torch.inference_mode()
def reference(model, prompt: list[int]) -> tuple[list[float], list[int]]:
    """Per prompt token after the first: its logprob, and the token the model ranks first there."""
    logprobs = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    scored = logprobs.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return scored.tolist(), logprobs.argmax(-1).tolist()


def prompts(hf) -> list[list[int]]:
    """A continuation the model would pick itself (greedy) and one of real text (it would not)."""
    model, tok = hf
    ids = tok.encode("The weather today is sunny")
    greedy = ids[:CONTEXT]
    for _ in range(3):
        greedy.append(reference(model, greedy + [0])[1][-1])
    return [greedy, ids]


def lm_eval_request(batch: list[list[int]], **extra) -> dict:
    return {"model": "m", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True, **extra}


def test_lm_eval_loglikelihood_matches_transformers(url, hf):
    model, tok = hf
    batch = prompts(hf)
    r = requests.post(url + "/v1/completions", json=lm_eval_request(batch), timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for prompt, choice, greedy in zip(batch, choices, (True, False)):
        assert choice["text"].startswith(tok.decode(prompt))
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt, then the one generated
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected, argmax = reference(model, prompt)
        got = logprobs["token_logprobs"][1:len(prompt)]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4, (got, expected)
        tops = logprobs["top_logprobs"][1:len(prompt)]
        assert [lp == max(top.values()) for lp, top in zip(got, tops)] == [
            a == t for a, t in zip(argmax, prompt[1:])]
        total, is_greedy = lm_eval_reading(choice, CONTEXT)
        assert total == pytest.approx(sum(expected[CONTEXT - 1:]), abs=1e-3)
        assert is_greedy == greedy
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)


def test_streamed_echo_scores_the_same(url, hf):
    batch = prompts(hf)[1:]
    plain = requests.post(url + "/v1/completions", json=lm_eval_request(batch), timeout=60).json()
    r = requests.post(url + "/v1/completions", json=lm_eval_request(batch, stream=True), timeout=60)
    first = next(json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {"))
    (choice,) = first["choices"]
    assert choice["text"] == plain["choices"][0]["text"]  # max_tokens 1: one event has it all
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        plain["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_chat_prompt_logprobs_at_the_top_level(url):
    r = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    scored = body["prompt_logprobs"]
    assert len(scored) == body["usage"]["prompt_tokens"] and scored[0] is None
    for entry in scored[1:]:
        assert 2 <= len(entry) <= 3  # the prompt token, and the top 2 (it may be one of them)
        assert {1, 2} <= {v["rank"] for v in entry.values()}
        assert all(isinstance(v["logprob"], float) and isinstance(v["decoded_token"], str)
                   for v in entry.values())


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_alone(url, hf, stream):
    """OpenAI's and vLLM's scoring request: the prompt's text and logprobs, nothing generated."""
    batch = prompts(hf)[1:]
    scored = requests.post(url + "/v1/completions", json=lm_eval_request(batch), timeout=60).json()
    body = lm_eval_request(batch, max_tokens=0, stream=stream,
                           **({"stream_options": {"include_usage": True}} if stream else {}))
    r = requests.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = ([json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
              if stream else [r.json()])
    choices = [c for e in events for c in e["choices"]]
    text = "".join(c["text"] for c in choices)
    tokens = sum((c["logprobs"]["tokens"] for c in choices if c["logprobs"]), [])
    logprobs = sum((c["logprobs"]["token_logprobs"] for c in choices if c["logprobs"]), [])
    want = scored["choices"][0]
    assert text == hf[1].decode(batch[0]) and len(tokens) == len(batch[0])
    assert logprobs[1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:len(batch[0])], abs=1e-5)
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert requests.post(url + "/v1/completions", json={**body, "echo": False},
                         timeout=60).status_code == 400  # max_tokens 0 without echo
