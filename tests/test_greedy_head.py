"""An all-greedy step's tokens from the LM head without its float32 logits
(flagserve/layers/greedy_head.py; the kernel's own tests: tests/kernels/test_cpu_greedy_head.py):
the head's tokens are its logits' argmax, a NaN row included; where it is built; and an engine
gives the same tokens with it as without, for greedy batches and batches that mix in sampled
rows and logprobs."""

import pytest
import torch

from flagserve import LLM, SamplingParams, StructuredOutputsParams
from flagserve.layers import greedy_head
from flagserve.layers.embedding import ParallelLMHead
from flagserve.layers.greedy_head import (
    AUTO_MIN_WEIGHTS,
    GREEDY_HEAD_ENV,
    Int8Logits,
    auto_approximation,
    greedy_head_for,
)
from kernels import cpu_native

needs_native = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                  reason="the native kernels are CPU-only and need a C++ compiler")


KINDS = ["bf16", "int8"]


def _head(monkeypatch, seed: int, kind: str) -> ParallelLMHead:
    """A random [1000, 64] head packed for the native kernel, with its greedy head."""
    monkeypatch.setenv(GREEDY_HEAD_ENV, kind)
    torch.manual_seed(seed)
    head = ParallelLMHead(1000, 64)
    head.weight.data.normal_()
    head.pack_for_cpu("native")
    assert head.greedy_head is not None
    return head


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_head_tokens_are_its_logits_argmax(monkeypatch, kind):
    head = _head(monkeypatch, 0, kind)
    hidden = torch.randn(30, 64) * 3
    hidden[4, 2] = float("nan")  # its logits are NaN: torch.argmax's answer, from the logits
    hidden[7, 5] = float("inf")
    hidden[9] = 0  # every logit 0: token 0, the first of a 1000-way tie
    hidden[11, 3] = 400  # an outlier: the rest of its row rounds to few int16 levels
    with torch.inference_mode():
        assert torch.equal(head.greedy(hidden), head(hidden).argmax(-1))


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_head_tokens_with_a_grammar_mask_are_the_masked_logits_argmax(monkeypatch, kind):
    # Rows that allow everything, a few tokens (the best one masked out), one token, and none
    # (left to the logits: what the sampler picks there); a NaN row stays the logits' answer.
    from kernels.sampling import apply_token_bitmask_torch
    head = _head(monkeypatch, 1, kind)
    hidden = torch.randn(6, 64) * 3
    hidden[5, 7] = float("nan")
    with torch.inference_mode():
        logits = head(hidden).float()
        allowed = torch.zeros(6, 1000, dtype=torch.bool)
        allowed[0] = True
        allowed[1, torch.randperm(1000)[:50]] = True
        allowed[1, logits[1].argmax()] = False
        allowed[2, 123] = True
        allowed[4, ::3] = True
        allowed[5] = True
        words = torch.zeros(6, 32, dtype=torch.int64)  # 1000 tokens in 32 words of 32 bits
        for row, token in allowed.nonzero().tolist():
            words[row, token // 32] |= 1 << (token % 32)
        bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        expected = apply_token_bitmask_torch(logits, bitmask).argmax(-1)
        assert torch.equal(head.greedy(hidden, bitmask), expected)
        assert expected[2] == 123 and expected[1] != logits[1].argmax()


@needs_native
def test_built_for_a_native_float32_head_on_one_rank(monkeypatch):
    weight = torch.randn(100, 16)
    for kind in KINDS:
        monkeypatch.setenv(GREEDY_HEAD_ENV, kind)
        assert isinstance(greedy_head_for(weight, 100, "native", 1).approx, Int8Logits) == (kind == "int8")
    # asked for by name where it cannot be: refused, naming why (it was dropped silently)
    for args in ((weight, 100, "onednn", 1), (weight, 100, "native", 2),
                 (weight.bfloat16(), 100, "native", 1)):
        with pytest.raises(ValueError, match=f"{GREEDY_HEAD_ENV}=int8 needs the native float32"):
            greedy_head_for(*args)
    monkeypatch.setenv(GREEDY_HEAD_ENV, "auto")
    assert greedy_head_for(weight, 100, "onednn", 1) is None
    assert greedy_head_for(weight, 100, "native", 2) is None
    assert greedy_head_for(weight.bfloat16(), 100, "native", 1) is None
    monkeypatch.setenv(GREEDY_HEAD_ENV, "off")
    assert greedy_head_for(weight, 100, "native", 1) is None
    monkeypatch.setenv(GREEDY_HEAD_ENV, "auto")
    assert greedy_head_for(weight, 100, "native", 1) is None  # small: the float32 head is as fast
    weight = torch.randn(AUTO_MIN_WEIGHTS // 16, 16)
    head = greedy_head_for(weight, weight.shape[0], "native", 1)
    assert (head is not None) == (auto_approximation() is not None)
    for kind in (*KINDS, None):  # AMX: bf16; AVX512-VNNI alone: int8; neither: the logits
        monkeypatch.setattr(greedy_head, "auto_approximation", lambda kind=kind: kind)
        head = greedy_head_for(weight, weight.shape[0], "native", 1)
        assert (head is not None) == (kind is not None)
        assert head is None or isinstance(head.approx, Int8Logits) == (kind == "int8")
    monkeypatch.setenv(GREEDY_HEAD_ENV, "yes")
    with pytest.raises(ValueError, match=GREEDY_HEAD_ENV):
        greedy_head_for(weight, 100, "native", 1)


def _run(llama_path, monkeypatch, mode, requests):
    monkeypatch.setenv(GREEDY_HEAD_ENV, mode)
    llm = LLM(llama_path, dtype="float32", device="cpu")
    head = llm.llm_engine.executor.runner.model.lm_head
    assert (head.greedy_head is not None) == (mode != "off")
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_engine_tokens_with_and_without_it(llama_path, monkeypatch, kind):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The weather today is", "We cook rice and beans", "Old computers", "count to 42"]
    # the sampled row and the one with logprobs end first: the later steps are all greedy
    mixed = [(p, greedy) for p in prompts] + [
        ("Write code", SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)),
        ("The river", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2))]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string"}},
              "required": ["n", "w"]}
    constrained = [(p, SamplingParams(temperature=0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(json=schema) if i % 2 else StructuredOutputsParams(regex="[a-z ]+"))))
        for i, p in enumerate(prompts)]
    for requests in ([(p, greedy) for p in prompts], mixed, constrained):
        assert _run(llama_path, monkeypatch, kind, requests) == _run(llama_path, monkeypatch, "off", requests)
