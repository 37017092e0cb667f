"""The referee: greedy tokens identical to HF transformers, logprobs within 1e-3."""
from collections import Counter
from dataclasses import fields, replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flagserve import LLM, SamplingParams
from flagserve.layers.greedy_head import GREEDY_HEAD_ENV
from flagserve.models.architectures import ARCHS

NEW_TOKENS = 40
PROMPTS = [
    "Hello",
    "The weather today is sunny and the",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 and then",
    # Several blocks of 16 tokens, not a multiple of the block size.
    "In the kitchen we cook rice and beans with salt, pepper and a lot of patience, because "
    "the recipe needs time. Meanwhile the old computer in the corner compiles code, the cat "
    "sleeps near the window and the rain taps on the roof until evening comes.",
]


def hf_greedy(path: str, prompts: list[str], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Like ignore_eos: EOS is generated and generation goes on (min_new_tokens would instead
    # forbid EOS and change the tokens).
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    llm = LLM(path, dtype="float32", attention_backend="torch")
    lengths = [len(llm.get_tokenizer().encode(p)) for p in PROMPTS]
    assert max(lengths) > 3 * 16, lengths  # one prompt spans several KV blocks
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    ref = hf_greedy(path, PROMPTS)
    for prompt, out, expected in zip(PROMPTS, outs, ref):
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason == "length"
    # Distinct continuations: a model stuck on one token would make this test toothless.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(PROMPTS)


BIASES = [("llama", {"attention_bias": True}), ("qwen3", {"attention_bias": True}),
          ("llama", {"mlp_bias": True})]


@pytest.mark.parametrize("arch,overrides", BIASES, ids=[f"{a}-{next(iter(o))}" for a, o in BIASES])
def test_optional_biases_match_transformers(arch, overrides, tiny_model_factory):
    """Llama's and Qwen3's attention_bias put biases on q/k/v and o_proj (transformers'
    layout), Llama's mlp_bias on the MLP: each loads, on the default CPU path, and matches."""
    path = tiny_model_factory(arch, **overrides)
    out = LLM(path, dtype="float32").generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(path, PROMPTS[:2], 12)


def test_an_activation_other_than_silu_is_refused(tiny_model_factory):
    path = tiny_model_factory("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*not supported"):
        LLM(path, dtype="float32")


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_last_layer_tail_runs_on_sampled_rows_only(backend, tiny_model_factory):
    """A prefill row that samples nothing only needs its K/V from the last layer: its o_proj
    and MLP run on the sampled rows alone (none in a chunk that ends no prompt), exactly as
    before, in mixed chunked steps too."""
    path = tiny_model_factory("qwen3")
    # Eager: a replayed CUDA graph would not call the hooks that count the rows.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, enforce_eager=True,
              attention_backend=backend, enable_prefix_caching=False)  # the prompts run twice
    layers = llm.llm_engine.executor.runner.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_hook(lambda _m, args, _out, name=name: rows[name].append(len(args[0])))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 8)
    steps = list(zip(rows["first"], rows["last"]))
    assert steps[0][0] == 32 and steps[0][1] < 32, steps  # a full chunk, fewer rows sampled
    assert all(last <= first for first, last in steps), steps
    assert sum(first for first, _ in steps) == sum(len(o.prompt_token_ids) for o in outs) + 4 * 7
    rows["first"].clear(), rows["last"].clear()
    long = llm.generate(PROMPTS[3:], params, use_tqdm=False)[0]  # its first chunk samples nothing
    assert long.outputs[0].token_ids == hf_greedy(path, PROMPTS[3:], 8)[0]
    assert (rows["first"][0], rows["last"][0]) == (32, 0)


# The kernels see no difference between llama and mistral or qwen2 (biases, other configs):
# llama (scaled RoPE) and qwen3 (q/k norm, head_dim apart from hidden / heads) cover them.
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_on_triton_kernels(arch, tiny_model_factory, monkeypatch):
    """The same referee with every op on our Triton kernels (the interpreter on CPU: kept short)."""
    from kernels import triton_ops

    calls = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    ops = triton_ops.TRITON_OPS
    spied = {f.name: counted(f.name, getattr(ops, f.name)) for f in fields(ops)
             if callable(getattr(ops, f.name))}
    monkeypatch.setattr(triton_ops, "TRITON_OPS", replace(ops, **spied))
    # the sampler's argmax too: an all-greedy CPU step may take its tokens from the LM head
    monkeypatch.setenv(GREEDY_HEAD_ENV, "off")
    path = tiny_model_factory(arch)
    llm = LLM(path, dtype="float32", attention_backend="triton")
    prompts = [PROMPTS[1], PROMPTS[3]]  # one decode-heavy, one several blocks long
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = hf_greedy(path, prompts, 8)
    # whole prompts (prefill_attention), then the same prompts on their cached prefixes
    # (paged_prefill_attention)
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    # The grammar's mask runs only for a constrained request (tests/test_structured_outputs.py),
    # logprobs' log-sum-exp and ranks only when they are asked for (the tests below).
    assert set(calls) == set(spied) - {"apply_token_bitmask", "lse_and_ranks"}, "every op ran on Triton"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_transformers(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=5)
    out = llm.generate(PROMPTS[1:3], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for req in out:
        comp = req.outputs[0]
        ids = torch.tensor([req.prompt_token_ids + comp.token_ids])
        with torch.no_grad():
            ref = model(ids).logits[0].float().log_softmax(-1)
        n = len(req.prompt_token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[n - 1 + i]
            assert abs(entry[token].logprob - row[token].item()) < 1e-3
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(5)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[tid].logprob - lp) < 1e-3
            total += row[token].item()
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-3)
