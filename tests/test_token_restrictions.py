"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens, refereed by HF transformers'
own logits processors (prefix_allowed_tokens_fn, bad_words_ids) on the same weights."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from flagserve import LLM, SamplingParams
from flagserve.engine.bad_words import bad_words_token_ids, banned_now

PROMPTS = ["The weather today is sunny and the", "Numbers: 1, 2, 3, 4 and then",
           "In the kitchen we cook rice and"]
NEW = 16


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


@pytest.fixture(scope="module")
def hf(llama_path):
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as ignore_eos
    return model


def hf_greedy(hf, ids: list[int], **kwargs) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **kwargs)


def test_allowed_token_ids_match_hf_and_leave_other_rows_alone(llm, hf):
    tok = llm.get_tokenizer()
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    # Each row's own allowed set: its unconstrained tokens minus their first, plus others.
    allowed = [sorted(set(p[1:]) | set(range(40, 90, 3))) for p in plain]
    params = [greedy(allowed_token_ids=a) for a in allowed[:2]] + [greedy()]
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, out, allow in zip(PROMPTS, outs, allowed[:2]):
        assert set(out) <= set(allow)
        assert out == hf_greedy(hf, tok.encode(prompt), prefix_allowed_tokens_fn=lambda _b, _i, a=allow: a)
    assert outs[0] != plain[0] and outs[2] == plain[2]  # it restricted; the free row is as alone
    # Allowing everything the free run produced changes nothing: the mask keeps their logits.
    superset = greedy(allowed_token_ids=sorted(set(plain[0]) | {1, 2, 3}))
    assert llm.generate(PROMPTS[:1], superset, use_tqdm=False)[0].outputs[0].token_ids == plain[0]


def test_allowed_token_ids_sampled_and_with_logprobs(llm):
    allow = [5, 17, 99, 250]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True,
                                                   allowed_token_ids=allow, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allow)
    # Logprobs are the model's own: the top alternatives are not limited to the allowed ids.
    assert any(set(step) - set(allow) for step in out.logprobs)


def word_of(tok, token_ids: list[int], length: int) -> tuple[list[str], list[list[int]]]:
    """The first span from the third token on whose text tokenizes back to `length` tokens."""
    for start in range(2, len(token_ids) - length):
        words = [tok.decode(token_ids[start:start + length])]
        if words[0].strip():
            sequences = bad_words_token_ids(tok, words, len(tok))
            if {len(s) for s in sequences} == {length}:
                return words, sequences
    raise AssertionError(f"no span of {length} tokens round-trips")


@pytest.mark.parametrize("length", [2, 1], ids=["several-tokens", "one-token"])
def test_bad_words_match_hf_bad_words_ids(llm, hf, length):
    """A word from the free output: of several tokens (banned only once its head is out) or of
    one (banned everywhere)."""
    tok = llm.get_tokenizer()
    plain = llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0].outputs[0]
    words, sequences = word_of(tok, plain.token_ids, length)
    outs = llm.generate(PROMPTS[:1] * 2, [greedy(bad_words=words), greedy()], use_tqdm=False)
    got = outs[0].outputs[0].token_ids
    assert got != plain.token_ids and outs[1].outputs[0].token_ids == plain.token_ids
    assert got == hf_greedy(hf, tok.encode(PROMPTS[0]), bad_words_ids=sequences)
    for seq in sequences:  # no banned sequence anywhere in the output
        assert not any(got[i:i + len(seq)] == seq for i in range(len(got)))


def test_banned_now_bans_the_last_token_after_the_head():
    words = [[7], [1, 2, 3]]
    assert banned_now(words, None) == [7]
    assert banned_now(words, [9, 1]) == [7]
    assert banned_now(words, [9, 1, 2]) == [7, 3]
    assert banned_now(words, [2]) == [7]


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens_keeps_that_side(llm, side):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    keep = 5
    kept = ids[-keep:] if side == "left" else ids[:keep]
    out = llm.generate([PROMPTS[2]], greedy(truncate_prompt_tokens=keep, truncation_side=side),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == kept
    assert out.outputs[0].token_ids == llm.generate([kept], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # Shorter prompts are left as they are.
    short = llm.generate([ids[:3]], greedy(truncate_prompt_tokens=keep), use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[:3]


def test_default_truncation_keeps_the_tokenizers_bos_as_hf_truncation_does(llm):
    """vLLM's default (no truncation_side): a text's special tokens stay, the rest is cut from
    the left: HF's own truncation of the text. Token ids are cut plainly."""
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    assert ids[0] == tok.bos_token_id
    tok.truncation_side = "left"
    hf = tok(PROMPTS[2], truncation=True, max_length=5).input_ids
    assert hf[0] == tok.bos_token_id and hf[1:] == ids[-4:]
    out = llm.generate([PROMPTS[2]], greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == hf
    by_ids = llm.generate([ids], greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids[-5:]


def test_truncate_prompt_tokens_minus_one_fits_the_context(llama_path):
    small = LLM(llama_path, dtype="float32", max_model_len=32)
    ids = list(range(10, 60))  # 50 tokens: past the context window
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate([ids], greedy(), use_tqdm=False)
    out = small.generate([ids], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-31:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens .*max_model_len"):
        small.generate([ids], greedy(truncate_prompt_tokens=32), use_tqdm=False)


def test_ids_past_the_vocabulary_are_refused(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids .*vocabulary size"):
        llm.generate(PROMPTS[:1], greedy(allowed_token_ids=[1, vocab]), use_tqdm=False)


def test_an_allowed_set_that_bans_leave_empty_wins_over_them(llm):
    """allowed_token_ids is a hard limit: where min_tokens or a bad word bans all of it, the
    bans give way for that row (before: every logit -inf, and token 0 came out)."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    out = llm.generate(PROMPTS[:1], greedy(allowed_token_ids=[eos], min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * NEW
    word = tok.encode(" the", add_special_tokens=False)
    assert len(word) == 1
    out = llm.generate(PROMPTS[:1], greedy(allowed_token_ids=word, bad_words=["the"]),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) == set(word)
