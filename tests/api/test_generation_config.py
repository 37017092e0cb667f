"""A model's generation_config.json sets the sampling defaults of requests that leave them
unset, offline and over HTTP, as vLLM's generation_config "auto"; "vllm" ignores it."""
from __future__ import annotations

import json
import shutil

import pytest
import requests

from flagserve import LLM, SamplingParams
from tests.api.conftest import serving

PROMPT = "The weather today is sunny and the"
# top_k 1 makes sampling greedy: what the defaults do shows in the tokens
DEFAULTS = {"temperature": 0.6, "top_k": 1, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def tuned(llama_path, tmp_path_factory):
    """The tiny model with sampling defaults in its generation_config.json."""
    path = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(llama_path, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    return str(path)


@pytest.fixture(scope="module")
def greedy_5(llama_path):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    return LLM(llama_path, dtype="float32").generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_offline_defaults_come_from_the_model(tuned, greedy_5):
    llm = LLM(tuned, dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.6, 1, 5)
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_5.token_ids
    plain = LLM(tuned, dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert len(plain.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_served_requests_default_to_the_model(tuned, greedy_5):
    with serving(tuned, "thread") as url:
        def chat(**body) -> dict:
            return requests.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True, **body}).json()
        got = chat()
        assert got["usage"]["completion_tokens"] == 5  # max_new_tokens caps an unset max_tokens
        again = chat(seed=3)
        assert again["choices"][0]["message"]["content"] == got["choices"][0]["message"]["content"]
        # a field the request sends wins: top_k -1 samples the whole vocabulary
        sampled = {chat(top_k=-1, temperature=1.0, seed=s, max_tokens=8)["choices"][0]["message"]["content"]
                   for s in range(4)}
        assert len(sampled) > 1
        text = requests.post(url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}).json()["choices"][0]["text"]
        assert text == greedy_5.text
        # completions' max_tokens: null takes the model's max_new_tokens (vLLM's fallback)
        unset = requests.post(url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": None, "ignore_eos": True}).json()
        assert unset["usage"]["completion_tokens"] == 5
