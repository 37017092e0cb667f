"""A vLLM script's offline calls run unchanged: its no-op engine args and arguments are taken,
its prompt dicts and engine method names work, and what FlagServe cannot do is refused by name."""
import logging

import pytest
import torch

from flagserve import LLM, EngineArgs, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32")


def test_vllm_only_engine_args_are_dropped_with_a_warning(llama_path, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(llama_path, dtype="half", trust_remote_code=True, swap_space=4, quantization=None,
                  revision=None, enable_lora=False, max_num_seqs=8)
    assert "ignoring vLLM-only engine args: enable_lora, quantization, revision, swap_space, " \
           "trust_remote_code" in caplog.text
    assert llm.llm_engine.args.dtype == "float16" and llm.llm_engine.args.max_num_seqs == 8
    with pytest.raises(TypeError, match="quantization"):  # a value FlagServe cannot honour
        LLM(llama_path, quantization="awq")
    assert EngineArgs(model="m", dtype=torch.bfloat16).dtype == "bfloat16"


def test_generate_and_chat_take_vllms_arguments(llm):
    out = llm.generate("Hi there", GREEDY, True, None, priority=[0])[0]
    assert out.request_id.isdigit() and out.outputs[0].finished()
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("Hi", GREEDY, lora_request=object())
    chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, False, None, TEMPLATE)[0]
    assert chat.prompt == "[user] Hi\n[assistant]"  # the rendered text, the caller's template
    assert chat.prompt_token_ids == llm.get_tokenizer().encode(chat.prompt, add_special_tokens=False)
    plain = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)[0]
    assert plain.prompt != chat.prompt and plain.prompt.rstrip().endswith("assistant")


def test_prompt_dicts_as_vllm_writes_them(llm):
    ids = llm.get_tokenizer().encode("Hi there")
    tokens = llm.generate({"prompt_token_ids": ids, "prompt": "Hi there"}, GREEDY, use_tqdm=False)[0]
    assert tokens.prompt == "Hi there" and tokens.prompt_token_ids == ids
    text = llm.generate({"prompt": "Hi there", "multi_modal_data": None}, GREEDY, use_tqdm=False)[0]
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    with pytest.raises(ValueError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": 1}}, GREEDY, use_tqdm=False)


def test_seed_minus_one_is_no_seed():
    assert SamplingParams(seed=-1).seed is None


def test_engine_methods_by_vllms_names(llama_path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_path, dtype="float32"))
    assert engine.get_tokenizer() is engine.tokenizer
    with pytest.raises(TypeError, match="request_id must be a str"):
        engine.add_request(3, "Hi", GREEDY)
    engine.add_request("a", {"prompt": "Hi"}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [1, 5, 9]}, GREEDY)
    engine.add_request("c", "Hello", GREEDY)
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 3
    engine.abort_request(["a", "b"])
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request("c")
    assert not engine.has_unfinished_requests()


def test_generate_leaves_another_callers_request_alone(llm):
    engine = llm.llm_engine
    engine.add_request("theirs", "We cook rice", SamplingParams(temperature=0, max_tokens=64,
                                                                ignore_eos=True))
    assert llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].finished()
    assert "theirs" in engine.requests  # still running, its outputs the caller's to collect
    engine.abort_request("theirs")


def test_sampling_params_clone_and_extra_args():
    params = SamplingParams(stop=["x"], extra_args={"mine": 1})
    copied = params.clone()
    copied.stop.append("y")
    assert params.stop == ["x"] and copied.extra_args == {"mine": 1}
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])


def test_reset_prefix_cache_forgets_cached_prefixes(llama_path):
    llm = LLM(llama_path, dtype="float32")
    prompt = "The weather today is sunny and the children play outside in the park " * 3
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    cold = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("held", prompt, GREEDY)
    engine.step()  # it holds blocks now
    assert not llm.reset_prefix_cache()
    engine.abort_request("held")
    assert llm.reset_prefix_cache()
