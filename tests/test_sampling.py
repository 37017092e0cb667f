"""Sampling parameters do what vLLM users expect."""
import json
import shutil

import pytest
import torch

from flagserve import LLM, SamplingParams
from flagserve.engine.outputs import RequestOutput
from flagserve.layers.sampler import SamplingBatch, apply_penalties

PROMPT = "The weather today is sunny and the"


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


def one(llm: LLM, params: SamplingParams, prompt: str = PROMPT) -> RequestOutput:
    return llm.generate([prompt], params, use_tqdm=False)[0]


def greedy(llm: LLM, n: int = 32, prompt: str = PROMPT):
    return one(llm, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), prompt).outputs[0]


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = one(llm, params).outputs[0].token_ids
    assert one(llm, params).outputs[0].token_ids == alone
    others = ["We cook rice", "Old computers", "Count to ten please"] * 3
    batch = llm.generate(others[:4] + [PROMPT] + others[4:],
                         [SamplingParams(temperature=1.0, max_tokens=30)] * 4 + [params]
                         + [SamplingParams(temperature=0.7, max_tokens=12)] * 5, use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert one(llm, other_seed).outputs[0].token_ids != alone
    assert alone != greedy(llm, 24).token_ids  # it really sampled


def test_seeds_that_differ_above_bit_31_sample_differently(llm):
    """The CPU generator keeps 32 bits of its seed: without the fold these were one stream."""
    def tokens(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
        return one(llm, params).outputs[0].token_ids
    base = tokens(5)
    assert tokens(5) == base
    assert tokens(5 + 2**32) != base and tokens(5 - 2**32) != base and tokens(5 + 2**40) != base


def test_n_returns_n_distinct_samples(llm):
    out = one(llm, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = one(llm, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    same = one(llm, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True))
    assert same.outputs[0].token_ids == same.outputs[1].token_ids == greedy(llm, 16).token_ids


def test_top_k_1_top_p_tiny_and_min_p_1_are_greedy(llm):
    expected = greedy(llm, 16).token_ids
    for params in (SamplingParams(top_k=1, seed=3, max_tokens=16, ignore_eos=True),
                   SamplingParams(top_p=1e-6, seed=3, max_tokens=16, ignore_eos=True),
                   SamplingParams(min_p=1.0, seed=3, max_tokens=16, ignore_eos=True)):
        assert one(llm, params).outputs[0].token_ids == expected, params


def test_stop_strings_end_the_text_before_them(llm):
    full = greedy(llm, 32)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip() and full.text.find(stop) > 0
    cut = full.text[:full.text.find(stop)]
    out = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop, "zzzz"]))
    comp = out.outputs[0]
    assert (comp.text, comp.finish_reason, comp.stop_reason) == (cut, "stop", stop)
    assert len(comp.token_ids) < 32
    kept = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stop,
                                   include_stop_str_in_output=True)).outputs[0]
    assert kept.text == cut + stop
    # vLLM's rule: a stop string counts only once the output is past min_tokens tokens
    hit = len(comp.token_ids)  # the token that completed the stop string
    for min_tokens, stops in ((hit - 1, True), (hit, False)):
        out = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stop,
                                      min_tokens=min_tokens)).outputs[0]
        assert (out.token_ids == comp.token_ids) == stops, (min_tokens, out)


def test_stop_token_ids_and_min_tokens(llm):
    full = greedy(llm, 32).token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    out = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                  stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == full[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    kept = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                   stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert kept.outputs[0].text == greedy(llm, first + 1).text  # vLLM's: the stop token's text kept
    # min_tokens forbids the stop token until 8 tokens are out.
    banned = one(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, min_tokens=8,
                                     stop_token_ids=[stop_id])).outputs[0]
    assert len(banned.token_ids) >= 8
    assert stop_id not in banned.token_ids[:8]


def test_eos_stops_unless_ignored(llama_path, tmp_path):
    full = greedy(LLM(llama_path, dtype="float32"), 32).token_ids
    eos = full[5]
    # The same weights, with a token the greedy path surely produces declared as EOS.
    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = [eos]
        (model / name).write_text(json.dumps(cfg))
    llm = LLM(str(model), dtype="float32")
    out = one(llm, SamplingParams(temperature=0, max_tokens=32)).outputs[0]
    first = full.index(eos)
    assert out.token_ids == full[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == llm.get_tokenizer().decode(full[:first])
    ignoring = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert one(llm, ignoring).outputs[0].token_ids == full


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_push_the_expected_way(llm):
    def tokens(**kw):
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
        return one(llm, params).outputs[0].token_ids

    base = repeats(tokens())
    assert base > 0, "the baseline must repeat for this test to mean anything"
    assert repeats(tokens(repetition_penalty=2.0)) < base
    assert repeats(tokens(presence_penalty=2.0)) < base
    assert repeats(tokens(frequency_penalty=2.0)) < base
    # Negative penalties reward what was already said.
    assert repeats(tokens(frequency_penalty=-2.0)) > base
    assert repeats(tokens(repetition_penalty=0.5)) > base


def test_penalty_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    batch = SamplingBatch(temperatures=torch.zeros(1), top_ks=None, top_ps=None, min_ps=None,
                          all_greedy=True, presence_penalties=torch.tensor([0.5]),
                          frequency_penalties=torch.tensor([0.25]), repetition_penalties=torch.tensor([2.0]),
                          output_token_ids=[[0, 0, 1]], prompt_token_ids=[[2]])
    out = apply_penalties(logits, batch)
    # token 0: 2/2 - 0.25*2 - 0.5; token 1: -2*2 - 0.25 - 0.5; token 2 (prompt only): 1/2; token 3 untouched
    assert out.tolist() == [[0.0, -4.75, 0.5, 0.5]]


def test_logprobs_zero_returns_only_the_sampled_token(llm):
    comp = one(llm, SamplingParams(temperature=0, max_tokens=4, logprobs=0)).outputs[0]
    assert [list(d) for d in comp.logprobs] == [[t] for t in comp.token_ids]
    assert all(d[t].rank == 1 for d, t in zip(comp.logprobs, comp.token_ids))


def test_logit_bias_forces_bans_and_leaves_other_rows_alone(llm):
    """+100 forces a token at every step, greedy or sampled; -100 on the plain greedy first
    token moves it; in a batch the unbiased rows are as alone; logprobs stay the model's."""
    plain = greedy(llm, 8)
    forced = (plain.token_ids[0] + 7) % 1000
    force = dict(max_tokens=8, ignore_eos=True, logit_bias={forced: 100.0})
    outs = llm.generate([PROMPT] * 3, [SamplingParams(temperature=0, logprobs=0, **force),
                                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                       SamplingParams(temperature=1.0, seed=5, **force)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [forced] * 8 == outs[2].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == plain.token_ids
    # The raw distribution's logprob of the forced token, not the biased one's (~0).
    assert all(step[forced].logprob < -1 for step in outs[0].outputs[0].logprobs)
    ban = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                         logit_bias={plain.token_ids[0]: -100})
    assert one(llm, ban).outputs[0].token_ids[0] != plain.token_ids[0]


def test_logit_bias_past_the_vocabulary_is_refused(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias .*vocabulary size"):
        one(llm, SamplingParams(logit_bias={vocab: 1.0}))


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("seed", "x"), ("stop", [1]), ("stop_token_ids", [-1]),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    # Issue 12: values the engine cannot hold (a seed past int64 killed the step loop).
    ("seed", 2**64), ("seed", -2**63 - 1), ("temperature", float("inf")), ("temperature", 1e308),
    ("temperature", float("nan")), ("top_k", 2**62), ("stop_token_ids", [2**70]), ("n", 10**6),
    ("repetition_penalty", float("inf")), ("repetition_penalty", 1e-300), ("min_p", float("nan")),
    ("max_tokens", 2**31), ("logprobs", 2**40), ("top_p", float("nan")),
    ("logit_bias", {5: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {2**40: 1.0}), ("logit_bias", [(5, 1.0)]),
    # a flag the detokenizer read as a bool failed the step of every request in the batch
    ("skip_special_tokens", None), ("skip_special_tokens", "no"), ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"), ("output_kind", 3),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5),
    ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", "word"), ("bad_words", [3]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 1.5),
    ("truncation_side", "middle"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_extreme_values_in_range_are_accepted():
    SamplingParams(seed=2**63 - 1, top_k=2**31 - 1, temperature=3e38, n=1024, stop_token_ids=[2**31 - 1])
    SamplingParams(seed=-2**63, repetition_penalty=1e-37, max_tokens=2**31 - 1)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plain_greedy_takes_the_argmax_of_the_model_dtype_logits(dtype):
    """Greedy rows with nothing to apply skip the fp32 copy of the logits: the same tokens as
    through it, ties (common in 16 bits) included, first index first."""
    from flagserve.layers.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=gen) * 4).round().to(dtype)  # many ties
    logits[3, 10] = logits[3, 500] = 1e4  # an exact tie at the top: the first wins
    plain = SamplingBatch(temperatures=None, top_ks=None, top_ps=None, min_ps=None, all_greedy=True)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    tokens = sampler(logits, plain).token_ids
    assert tokens == logits.float().argmax(-1).tolist() and tokens[3] == 10
    with_logprobs = SamplingBatch(temperatures=None, top_ks=None, top_ps=None, min_ps=None,
                                  all_greedy=True, max_num_logprobs=0)
    out = sampler(logits, with_logprobs)  # the fp32 path, for the logprobs
    assert out.token_ids == tokens and out.logprobs is not None


def test_child_seeds_of_distinct_seeds_differ():
    """The n samples' seeds: one to one in the request's seed at every index (seeds 2**63
    apart made the same samples past the first), and within a generator's range."""
    from flagserve.engine.llm_engine import child_seed
    seeds = [-2**63, -1, 0, 1, 5, 2**32 + 5, 2**63 - 1]
    for index in (1, 2, 7):
        children = [child_seed(s, index) for s in seeds]
        assert len(set(children)) == len(seeds) and all(0 <= c < 2**64 for c in children)
    assert child_seed(-1, 0) == -1  # the first sample is the seed's own, as n=1


def test_the_models_other_eos_ids_name_themselves_in_stop_reason(llm):
    """vLLM's: the tokenizer's EOS ends with stop_reason None; generation_config.json's other
    end-of-sequence ids (the tiny model's <|im_end|>) act as stop tokens and name themselves."""
    engine = llm.llm_engine
    primary = engine.tokenizer.eos_token_id
    other = next(t for t in engine.eos_token_ids if t != primary)
    for token, reason in ((primary, None), (other, other)):
        out = one(llm, SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[token])).outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", reason)
