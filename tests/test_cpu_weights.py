"""Weights of bfloat16 values stored in bfloat16 on CPU (layers/cpu_matmul.py): a bf16
checkpoint runs in float32 on CPU (`dtype: auto`) and gives the same tokens and logprobs, bit
for bit, with its linear layers and LM head packed in bfloat16 (FLAGSERVE_CPU_WEIGHTS=auto) as
in float32; through the native layers (Llama) and the Python ones (Qwen3's q/k norm); weights
with any other value stay float32."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flagserve import LLM, SamplingParams
from flagserve.layers.cpu_matmul import WEIGHTS_ENV, holds_bfloat16, pack_weight
from flagserve.models.config import auto_dtype, load_model_config
from kernels import cpu_native

needs_native = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                  reason="the native kernels are CPU-only and need a C++ compiler")


def _bf16_checkpoint(src: str, out: Path) -> str:
    """The tiny model as a bf16 checkpoint: its weights rounded to bfloat16 and saved so."""
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    save_file({name: t.bfloat16() for name, t in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _run(path, monkeypatch, weights):
    monkeypatch.setenv(WEIGHTS_ENV, weights)
    llm = LLM(path, device="cpu", max_num_seqs=4, max_num_batched_tokens=24)  # dtype auto
    model = llm.llm_engine.executor.runner.model
    assert {p.dtype for p in model.parameters() if p.numel()} == {torch.float32}
    stored = {m.packed.data.dtype for m in model.modules() if getattr(m, "packed", None) is not None}
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=1)]
    prompts = ["The weather today is", " ".join(["a long prompt"] * 12)]  # chunked, beside decodes
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stored


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_checkpoint_in_float32_gives_the_same_bits(tiny_model_factory, monkeypatch,
                                                          tmp_path, arch):
    path = _bf16_checkpoint(tiny_model_factory(arch), tmp_path / "bf16")
    cfg = load_model_config(path)
    assert cfg.torch_dtype == "bfloat16"
    assert (auto_dtype(cfg, on_gpu=False), auto_dtype(cfg, on_gpu=True)) == ("float32", "bfloat16")
    narrow, narrow_stored = _run(path, monkeypatch, "auto")
    wide, wide_stored = _run(path, monkeypatch, "float32")
    assert narrow_stored == {torch.bfloat16} and wide_stored == {torch.float32}
    assert narrow == wide


@needs_native
def test_only_weights_of_bfloat16_values_are_stored_so(monkeypatch):
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    assert holds_bfloat16(weight) and holds_bfloat16(weight, rows=5)  # any row split
    off = weight.clone()
    off[63, 47] = torch.nextafter(off[63, 47], torch.tensor(float("inf")))  # a float32 ulp off
    assert not holds_bfloat16(off) and not holds_bfloat16(off, rows=5)
    assert not holds_bfloat16(weight.double())
    monkeypatch.setenv(WEIGHTS_ENV, "auto")
    assert pack_weight(weight, "native").data.dtype == torch.bfloat16
    assert pack_weight(off, "native").data.dtype == torch.float32
    monkeypatch.setenv(WEIGHTS_ENV, "float32")
    assert pack_weight(weight, "native").data.dtype == torch.float32
    monkeypatch.setenv(WEIGHTS_ENV, "bf16")
    with pytest.raises(ValueError, match=WEIGHTS_ENV):
        pack_weight(weight, "native")
