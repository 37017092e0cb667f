"""prompt_logprobs against HF's log-softmax over the whole prompt, and the same whatever the
engine does meanwhile: chunked prefill, a warm prefix cache, preemption, n > 1, DELTA outputs."""
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from flagserve import LLM, SamplingParams
from flagserve.engine.sampling_params import RequestOutputKind
from tests.conftest import prompt_set

# CUDA GEMMs sum in another order than HF's CPU ones (test_hf_parity's 1e-3 there)
TOL = 1e-3 if torch.cuda.is_available() else 1e-4
TOP = 3
SCORE = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def prompts(llama_path):
    ids = prompt_set(LLM(llama_path).get_tokenizer(), 6, seed=3, min_len=20, max_len=70)
    return ids + [ids[0][:1]]  # a one-token prompt scores nothing


@pytest.fixture(scope="module")
def hf_logprobs(llama_path, prompts):
    """Per prompt: HF's log-softmax at each position but the last, [P - 1, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


def check_against_hf(prompt: list[int], scored, ref: torch.Tensor) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    for pos, entry in enumerate(scored[1:]):
        row, token = ref[pos], prompt[pos + 1]
        own = entry[token]
        assert abs(own.logprob - row[token].item()) < TOL
        # Ranks as HF's, up to ties within the tolerance.
        assert (row > own.logprob + TOL).sum() + 1 <= own.rank <= (row > own.logprob - TOL).sum() + 1
        tops = sorted((lp for lp in entry.values() if lp.rank <= TOP), key=lambda lp: lp.rank)
        assert [lp.rank for lp in tops] == list(range(1, TOP + 1))
        expected = row.topk(TOP).values.tolist()
        assert all(abs(lp.logprob - e) < TOL for lp, e in zip(tops, expected))
        assert all(abs(row[t].item() - lp.logprob) < TOL for t, lp in entry.items())
        assert len(entry) in (TOP, TOP + 1)


def test_prompt_logprobs_match_hf_in_chunks(llama_path, prompts, hf_logprobs):
    # Chunks of 32 tokens across blocks of 16, with the prompts in the prefix cache.
    llm = LLM(llama_path, dtype="float32", max_num_batched_tokens=32)
    plain = replace(SCORE, prompt_logprobs=None)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    outs = llm.generate(prompts, SCORE, use_tqdm=False)
    for prompt, out, ref, before in zip(prompts, outs, hf_logprobs, alone):
        check_against_hf(prompt, out.prompt_logprobs, ref)
        assert out.outputs[0].token_ids == before.outputs[0].token_ids  # sampling unchanged
        assert before.prompt_logprobs is None
        assert out.num_cached_tokens == 0  # scored rows are computed, never read from the cache
    assert llm.generate(prompts[:1], plain, use_tqdm=False)[0].num_cached_tokens > 0  # it was warm


def test_preemption_and_n_leave_prompt_logprobs_whole(llama_path, prompts, hf_logprobs):
    llm = LLM(llama_path, dtype="float32", num_kv_blocks=10, max_num_batched_tokens=24,
              max_model_len=160)
    params = replace(SCORE, n=2, max_tokens=40)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for prompt, out, ref in zip(prompts, outs, hf_logprobs):
        check_against_hf(prompt, out.prompt_logprobs, ref)
        assert len(out.outputs) == 2
    assert llm.llm_engine.block_manager.num_free_blocks == 10  # nothing leaked


def test_delta_outputs_carry_them_once(llama_path, prompts, hf_logprobs):
    llm = LLM(llama_path, dtype="float32", max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("r", prompts[1], replace(SCORE, output_kind=RequestOutputKind.DELTA))
    carried = []
    while engine.has_unfinished():
        for out in engine.step():
            carried.append((out.prompt_logprobs, out.outputs[0].token_ids))
    with_scores = [(lps, tokens) for lps, tokens in carried if lps is not None]
    assert len(with_scores) == 1 and with_scores[0][1]  # once, with the first token
    check_against_hf(prompts[1], with_scores[0][0], hf_logprobs[1])


def test_out_of_range_is_refused(llama_path):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(llama_path, dtype="float32")
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt_logprobs must be <= the vocabulary size"):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=vocab + 1), use_tqdm=False)
