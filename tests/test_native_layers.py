"""A step's decoder layers as one native call (flagserve/models/native_layers.py,
kernels/csrc/cpu_decoder_layers.cpp): an engine gives the same tokens and logprobs, bit for
bit, with it as without (greedy, seeded sampling, logprobs, prompt logprobs, a prefix-cache
hit, chunked prompts beside decodes; Llama and Qwen2's qkv bias), it runs every kind of step,
and it stands aside where the Python layers differ from it (Qwen3's q/k norm, inductor's ops,
the switch off)."""
import pytest
import torch

from flagserve import LLM, SamplingParams
from flagserve.models import native_layers
from flagserve.models.native_layers import NATIVE_LAYERS_ENV, NativeLayers
from kernels import cpu_native

needs_native = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                  reason="the native kernels are CPU-only and need a C++ compiler")


def _run(path, monkeypatch, mode):
    monkeypatch.setenv(NATIVE_LAYERS_ENV, mode)
    steps = []  # (rows, decode rows, rows kept) of each call
    original = NativeLayers.__call__

    def counted(self, positions, hidden, residual, meta, keep=None):
        kept = hidden.shape[0] if keep is None else keep.shape[0]
        steps.append((hidden.shape[0], meta.num_decode_tokens, kept))
        return original(self, positions, hidden, residual, meta, keep)

    monkeypatch.setattr(NativeLayers, "__call__", counted)
    # 24 tokens a step: the long prompt runs in chunks, beside the others' decodes
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=24)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=9, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    prompts = ["The weather today is", "We cook rice and beans", "Old computers", "count to 42",
               "The weather today is sunny",  # hits the first one's cached prefix
               " ".join(["a long prompt"] * 20), "score this prompt please"]
    outs = llm.generate(prompts, [greedy, sampled, greedy, sampled, greedy, sampled, scored],
                        use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_outputs_identical_with_and_without_it(tiny_model_factory, monkeypatch, arch):
    path = tiny_model_factory(arch)
    on, steps = _run(path, monkeypatch, "on")
    off, no_steps = _run(path, monkeypatch, "off")
    assert on == off
    assert not no_steps
    # every kind of step ran natively: decodes alone, prompts alone, both, rows left out
    assert any(decodes == rows for rows, decodes, _ in steps)
    assert any(decodes == 0 for _, decodes, _ in steps)
    assert any(0 < decodes < rows for rows, decodes, _ in steps)
    assert any(kept < rows for rows, _, kept in steps)


@needs_native
def test_it_stands_aside_where_the_layers_differ(tiny_model_factory, monkeypatch):
    def native(path, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        llm = LLM(path, dtype="float32", device="cpu")
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        return llm.llm_engine.executor.runner.model.native_layers

    llama = tiny_model_factory("llama")
    assert native(llama, **{NATIVE_LAYERS_ENV: "on"}) is not None
    assert native(tiny_model_factory("qwen3"), **{NATIVE_LAYERS_ENV: "on"}) is None  # q/k norm
    assert native(llama, **{NATIVE_LAYERS_ENV: "off"}) is None
    assert native(llama, **{NATIVE_LAYERS_ENV: "on", "FLAGSERVE_CPU_COMPILE": "ops"}) is None
    monkeypatch.setenv(NATIVE_LAYERS_ENV, "yes")
    with pytest.raises(ValueError, match=NATIVE_LAYERS_ENV):
        native_layers.supported(torch.nn.ModuleList([torch.nn.Linear(1, 1)]), 1, False)


@needs_native
def test_python_layers_run_gate_up_and_silu_in_one_pass(tiny_model_factory, monkeypatch):
    """Where the layers stay in Python (Qwen3's q/k norm here), the MLP's gate-up linear ends in
    SiLU-and-mul too (ops.packed_silu_and_mul): the same outputs as the two passes."""
    path = tiny_model_factory("qwen3")

    def run(impl):
        rows = []

        def counted(x, packed, out_features, bias):
            rows.append(x.shape[0])
            return impl(x, packed, out_features, bias)

        monkeypatch.setattr(cpu_native, "packed_linear_silu", counted)
        return _run(path, monkeypatch, "on")[0], rows

    def two_passes(x, packed, out_features, bias):
        return cpu_native.silu_and_mul_cpu(cpu_native.packed_linear(x, packed, out_features, bias))

    fused, rows = run(cpu_native.packed_linear_silu)
    assert rows and max(rows) > 1  # prompt chunks and decodes went through it
    assert fused == run(two_passes)[0]
