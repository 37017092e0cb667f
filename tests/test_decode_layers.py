"""A decode step's layers as one native call (flagserve/models/native_decode.py,
kernels/csrc/cpu_decode_layers.cpp): an engine gives the same tokens and logprobs, bit for bit,
with it as without (greedy, seeded sampling, logprobs, a prefix-cache hit; Llama and Qwen2's
qkv bias), it takes the decode steps and only those, and it stands aside where the Python
layers differ from it (Qwen3's q/k norm, inductor's ops, the switch off)."""
import pytest
import torch

from flagserve import LLM, SamplingParams
from flagserve.models import native_decode
from flagserve.models.native_decode import DECODE_LAYERS_ENV, NativeDecode
from kernels import cpu_native

needs_native = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                  reason="the native kernels are CPU-only and need a C++ compiler")


def _run(path, monkeypatch, mode):
    monkeypatch.setenv(DECODE_LAYERS_ENV, mode)
    calls = []
    original = NativeDecode.__call__

    def counted(self, positions, hidden, residual, meta):
        calls.append(hidden.shape[0])
        return original(self, positions, hidden, residual, meta)

    monkeypatch.setattr(NativeDecode, "__call__", counted)
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=9, ignore_eos=True)
    prompts = ["The weather today is", "We cook rice and beans", "Old computers", "count to 42",
               "The weather today is sunny"]  # the last one hits the first one's cached prefix
    outs = llm.generate(prompts, [greedy, sampled, greedy, sampled, greedy], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_outputs_identical_with_and_without_it(tiny_model_factory, monkeypatch, arch):
    path = tiny_model_factory(arch)
    on, calls = _run(path, monkeypatch, "on")
    off, no_calls = _run(path, monkeypatch, "off")
    assert on == off
    assert calls and not no_calls
    assert max(calls) <= 4  # decode steps only: a prompt's step has more rows than sequences


@needs_native
def test_it_stands_aside_where_the_layers_differ(tiny_model_factory, monkeypatch):
    def native(path, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        llm = LLM(path, dtype="float32", device="cpu")
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        return llm.llm_engine.executor.runner.model.native_decode

    llama = tiny_model_factory("llama")
    assert native(llama, **{DECODE_LAYERS_ENV: "on"}) is not None
    assert native(tiny_model_factory("qwen3"), **{DECODE_LAYERS_ENV: "on"}) is None  # q/k norm
    assert native(llama, **{DECODE_LAYERS_ENV: "off"}) is None
    assert native(llama, **{DECODE_LAYERS_ENV: "on", "FLAGSERVE_CPU_COMPILE": "ops"}) is None
    monkeypatch.setenv(DECODE_LAYERS_ENV, "yes")
    with pytest.raises(ValueError, match=DECODE_LAYERS_ENV):
        native_decode.supported(torch.nn.ModuleList([torch.nn.Linear(1, 1)]), 1, False)
