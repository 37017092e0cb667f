"""vLLM's tokenizer routes, /tokenize, /detokenize and /tokenizer_info, which lm-eval's
local-completions model detects to use the server's tokenizer (its remote backend).

Over HTTP: the ingress on its own uvicorn server over the tiny model's engine (no Ray),
checked against HF's tokenizer and against what /v1/chat/completions counts. The tokenizer
deployment's methods: through the ingress's handlers on a stand-in for its Ray Serve handle.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import requests
from transformers import AutoTokenizer

from flagserve.config.schema import ApiLimits
from flagserve.entrypoints.openai.engine_client import ModelInfo
from flagserve.entrypoints.openai.errors import OpenAIError
from flagserve.entrypoints.openai.ingress import ModelRoute, OpenAIIngress
from flagserve.entrypoints.openai.tokenizer import PromptTokenizer
from flagserve.serve.tokenizer_deployment import TokenizerDeployment

MAX_MODEL_LEN = 512  # conftest.serving()'s
TEXT = "The weather today is sunny, so we cook rice."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def hf(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


def post(url: str, route: str, **body) -> requests.Response:
    return requests.post(url + route, json=body, timeout=60)


def error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# /tokenize

@pytest.mark.parametrize("special", [True, False])
def test_tokenize_text_is_hf_encode(url, hf, special):
    r = post(url, "/tokenize", prompt=TEXT, add_special_tokens=special, return_token_strs=True)
    assert r.status_code == 200, r.text
    expected = hf.encode(TEXT, add_special_tokens=special)
    assert r.json() == {"count": len(expected), "max_model_len": MAX_MODEL_LEN,
                        "tokens": expected, "token_strs": hf.convert_ids_to_tokens(expected)}


def test_tokenize_adds_special_tokens_by_default_as_completions_do(url, hf):
    tokens = post(url, "/tokenize", model="m", prompt=TEXT).json()["tokens"]
    assert tokens == hf.encode(TEXT) != hf.encode(TEXT, add_special_tokens=False)  # BOS first
    assert post(url, "/tokenize", prompt=TEXT).json()["token_strs"] is None  # not asked


@pytest.mark.parametrize("extra", [{}, {"add_generation_prompt": False}, {"tools": TOOLS}])
def test_tokenize_messages_counts_what_chat_completions_prompts(url, extra):
    tokenized = post(url, "/tokenize", messages=MESSAGES, **extra).json()
    chat = post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, **extra).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"] == len(tokenized["tokens"])
    if extra:  # each changes the prompt: the fields reach the template
        assert tokenized["count"] != post(url, "/tokenize", messages=MESSAGES).json()["count"]


def test_tokenize_messages_is_the_rendered_template(url, hf):
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    plain = post(url, "/tokenize", messages=MESSAGES).json()["tokens"]
    assert plain == hf.encode(text, add_special_tokens=False)  # BOS from the template only
    doubled = post(url, "/tokenize", messages=MESSAGES, add_special_tokens=True).json()["tokens"]
    assert doubled == hf.encode(text)  # and one from the tokenizer, as vLLM's


# /detokenize

def test_detokenize_round_trips(url, hf):
    ids = post(url, "/tokenize", prompt=TEXT, add_special_tokens=False).json()["tokens"]
    assert post(url, "/detokenize", tokens=ids).json() == {"prompt": TEXT}
    with_bos = hf.encode(TEXT)
    assert post(url, "/detokenize", model="m", tokens=with_bos).json()["prompt"] == hf.decode(with_bos)
    assert hf.decode(with_bos).startswith(hf.bos_token)  # special tokens kept, as vLLM's


@pytest.mark.parametrize("bad", [-1, "len"])
def test_detokenize_out_of_vocabulary_is_400(url, hf, bad):
    bad = len(hf) if bad == "len" else bad
    err = error(post(url, "/detokenize", tokens=[5, bad]), 400)
    assert err["param"] == "tokens" and str(bad) in err["message"], err


# /tokenizer_info

def test_tokenizer_info_names_the_tokens_and_the_served_context(url, hf):
    for query in ("", "?model=m", "?model=llm"):
        info = requests.get(url + "/tokenizer_info" + query, timeout=10).json()
        assert (info["eos_token"], info["bos_token"]) == (hf.eos_token, hf.bos_token) != (None, None)
        assert info["model_max_length"] == MAX_MODEL_LEN != hf.model_max_length
        assert info["chat_template"] == hf.chat_template and info["tokenizer_class"]
        assert {"pad_token", "unk_token"} <= set(info)
    assert info["model"] == "llm" and requests.get(url + "/tokenizer_info", timeout=10).json()["model"] == "m"


# Routing and refusals, as the other routes

def test_unknown_model_is_404(url):
    assert "nope" in error(post(url, "/tokenize", model="nope", prompt="x"), 404)["message"]
    error(post(url, "/detokenize", model="nope", tokens=[1]), 404)
    error(requests.get(url + "/tokenizer_info?model=nope", timeout=10), 404)


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {"prompt": "x", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/detokenize", {"prompt": "x", "tokens": [1]}, "prompt"),
])
def test_malformed_and_unknown_fields_are_400_naming_them(url, route, body, param):
    assert error(post(url, route, **body), 400)["param"] == param


def test_tokenizer_info_refuses_unknown_query_parameters(url):
    assert error(requests.get(url + "/tokenizer_info?modle=m", timeout=10), 400)["param"] == "modle"


# The same routes with a tokenizer deployment: its methods, called through a stand-in handle

class _Handle:
    """A DeploymentHandle of the tokenizer deployment, its methods called in this process."""

    def __init__(self, deployment: TokenizerDeployment):
        self.deployment = deployment

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self.deployment, name))


class _BareIngress(OpenAIIngress):
    def __del__(self) -> None:  # Ray Serve's async stop: no engine or server here to stop
        pass


def bare_ingress(path: str, deployed: bool) -> OpenAIIngress:
    """An OpenAIIngress with no engine: what the tokenizer routes read of it."""
    handle = _Handle(TokenizerDeployment(path)) if deployed else None
    route = ModelRoute("llm", ["m"], None, path, handle, [])
    ingress = object.__new__(_BareIngress)
    ingress.routes, ingress.by_name, ingress.limits = [route], {"m": route}, ApiLimits()
    ingress.tokenizers = {} if deployed else {"llm": PromptTokenizer(path)}
    ingress.infos = {"llm": ModelInfo("llm", "m", path, MAX_MODEL_LEN, 1536)}
    ingress.tokenizer_infos = {}
    return ingress


def call(handler, body: dict | None = None, query: dict | None = None) -> dict:
    async def read() -> bytes:
        return json.dumps(body).encode()

    response = asyncio.run(handler(SimpleNamespace(body=read, query_params=query or {})))
    return json.loads(response.body)


@pytest.mark.parametrize("deployed", [False, True], ids=["in process", "deployment"])
def test_tokenizer_routes_in_process_and_through_the_tokenizer_deployment(llama_path, hf, deployed):
    ingress = bare_ingress(llama_path, deployed)
    for special in (True, False):
        got = call(ingress.tokenize, {"prompt": TEXT, "add_special_tokens": special,
                                      "return_token_strs": True})
        assert got["tokens"] == hf.encode(TEXT, add_special_tokens=special)
        assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for special in (True, False):
        got = call(ingress.tokenize, {"messages": MESSAGES, "add_special_tokens": special})
        assert got["tokens"] == hf.encode(text, add_special_tokens=special)
    ids = hf.encode(TEXT, add_special_tokens=False)
    assert call(ingress.detokenize, {"tokens": ids}) == {"prompt": TEXT}
    with pytest.raises(OpenAIError) as err:
        call(ingress.detokenize, {"tokens": [len(hf)]})
    assert (err.value.status, err.value.param) == (400, "tokens")
    info = call(ingress.tokenizer_info, query={"model": "m"})
    assert (info["eos_token"], info["model_max_length"], info["model"]) == (hf.eos_token,
                                                                           MAX_MODEL_LEN, "m")


def test_version_names_the_package(url):
    import importlib.metadata
    r = requests.get(url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("flagserve")}
