"""The opt-in compiled CPU ops (flagserve/engine/cpu_compile.py): not bit-exact, so greedy
tokens identical to transformers and logprobs within a tolerance of the eager engine."""
import pytest

from flagserve import LLM, SamplingParams
from flagserve.engine.cpu_compile import compile_mode
from tests.test_hf_parity import PROMPTS, hf_greedy


def test_compile_mode(monkeypatch):
    monkeypatch.delenv("FLAGSERVE_CPU_COMPILE", raising=False)
    assert compile_mode(enforce_eager=False) == "off"  # off by default: measured slower
    assert compile_mode(enforce_eager=False, requested="ops") == "ops"
    assert compile_mode(enforce_eager=True, requested="ops") == "off"
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_COMPILE"):
        compile_mode(enforce_eager=False, requested="max-autotune")


def test_compiled_ops_keep_greedy_parity_and_logprobs(tiny_model_factory, monkeypatch):
    path = tiny_model_factory("qwen3")  # q/k norm too: every compiled op on the path
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    eager = LLM(path, dtype="float32", attention_backend="torch").generate(PROMPTS, params,
                                                                           use_tqdm=False)
    monkeypatch.setenv("FLAGSERVE_CPU_COMPILE", "ops")
    llm = LLM(path, dtype="float32", attention_backend="torch", enforce_eager=False)
    assert llm.llm_engine.executor.runner.model.layers[0].mlp.ops.name.endswith("+inductor")
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, ref, expected in zip(outs, eager, hf_greedy(path, PROMPTS, 24)):
        assert out.outputs[0].token_ids == expected
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            token = next(iter(want))
            assert abs(got[token].logprob - want[token].logprob) < 1e-4
