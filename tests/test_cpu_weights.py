"""Weights stored in fewer bytes on CPU (layers/cpu_matmul.py): a bf16 (or fp16) checkpoint
runs in float32 on CPU (`dtype: auto`) and gives the same tokens and logprobs, bit for bit,
with its linear layers and LM head packed in bfloat16 (float16) (FLAGSERVE_CPU_WEIGHTS=auto)
as in float32; a GGUF file of Q4_1 and Q8_0 blocks the same with its few-row steps reading
the blocks, one of F16 tensors packed in float16; through the native layers (Llama) and the
Python ones (Qwen3's q/k norm); weights with any other value stay float32."""
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from flagserve import LLM, SamplingParams
from flagserve.layers.cpu_matmul import (
    FEW_ROWS,
    WEIGHTS_ENV,
    holds_bfloat16,
    holds_float16,
    pack_weight,
)
from flagserve.layers.cpu_quantized import Q4_1, Q8_0, find_blocks
from flagserve.models.config import auto_dtype, load_model_config
from kernels import cpu_native
from tests.gguf_files import write_gguf

needs_native = pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                                  reason="the native kernels are CPU-only and need a C++ compiler")


def _half_checkpoint(src: str, out: Path, dtype: torch.dtype = torch.bfloat16) -> str:
    """The tiny model as a bf16 (fp16) checkpoint: its weights rounded so and saved so."""
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    save_file({name: t.to(dtype) for name, t in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _run(path, monkeypatch, weights, long_prompt=False):
    """(prompt logprobs, tokens, logprobs) of a greedy and a sampled request, and how the
    packed weights are stored: {(dtype, the few-row packing's bytes per column and block of
    32 weights, or None)}.
    long_prompt: a prompt of more than FEW_ROWS tokens in one step (the float32 packing)."""
    monkeypatch.setenv(WEIGHTS_ENV, weights)
    batched = 2 * FEW_ROWS if long_prompt else 24
    llm = LLM(path, device="cpu", max_num_seqs=4, max_num_batched_tokens=batched)  # dtype auto
    model = llm.llm_engine.executor.runner.model
    assert {p.dtype for p in model.parameters() if p.numel()} == {torch.float32}
    stored = {(m.packed.data.dtype, _block_bytes(m.packed))
              for m in model.modules() if getattr(m, "packed", None) is not None}
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=1)]
    words = 40 if long_prompt else 12
    prompts = ["The weather today is", " ".join(["a long prompt"] * words)]  # chunked, or not
    if long_prompt:
        assert len(llm.get_tokenizer().encode(prompts[1])) > FEW_ROWS
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stored


def _block_bytes(packed) -> int | None:
    """Bytes per column and block of 32 weights of the few-row packing: 20 for Q4_1 (two
    float16 scales, 16 bytes of nibbles), 34 for Q8_0 (a scale, 32 int8); None for none."""
    return None if packed.few is None else packed.few.shape[-1] // packed.data.shape[-1]


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_checkpoint_in_float32_gives_the_same_bits(tiny_model_factory, monkeypatch,
                                                          tmp_path, arch):
    path = _half_checkpoint(tiny_model_factory(arch), tmp_path / "bf16")
    cfg = load_model_config(path)
    assert cfg.torch_dtype == "bfloat16"
    assert (auto_dtype(cfg, on_gpu=False), auto_dtype(cfg, on_gpu=True)) == ("float32", "bfloat16")
    narrow, narrow_stored = _run(path, monkeypatch, "auto")
    wide, wide_stored = _run(path, monkeypatch, "float32")
    assert narrow_stored == {(torch.bfloat16, None)} and wide_stored == {(torch.float32, None)}
    assert narrow == wide


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # its own LM head; tied to the embedding
def test_a_q4_1_gguf_gives_the_same_bits(tiny_model_factory, monkeypatch, tmp_path, arch):
    """SmolLM2's kind of file: linear layers in Q4_1, the token embedding in Q8_0. Every
    linear and the LM head get a packing of their blocks, which the decodes read; the long
    prompt's step reads the float32 packing."""
    monkeypatch.setenv("FLAGSERVE_CACHE", str(tmp_path / "cache"))  # the GGUF tokenizer's
    path = str(write_gguf(tiny_model_factory(arch), tmp_path / "tiny.gguf", "Q4_1"))
    blocks, blocks_stored = _run(path, monkeypatch, "auto", long_prompt=True)
    wide, wide_stored = _run(path, monkeypatch, "float32", long_prompt=True)
    # Qwen2's head is the Q8_0 embedding; Llama's own is Q4_1, one of the layers' kind
    head = {(torch.float32, 34)} if arch == "qwen2" else set()
    assert blocks_stored == {(torch.float32, 20)} | head and wide_stored == {(torch.float32, None)}
    assert blocks == wide


@needs_native
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float16_weights_are_stored_in_float16(tiny_model_factory, monkeypatch, tmp_path, source):
    """An fp16 checkpoint and a GGUF file of F16 tensors: every linear and the LM head in
    float16, the same bits as in float32."""
    monkeypatch.setenv("FLAGSERVE_CACHE", str(tmp_path / "cache"))
    if source == "hf":
        path = _half_checkpoint(tiny_model_factory("llama"), tmp_path / "fp16", torch.float16)
    else:
        path = str(write_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", "F16"))
    narrow, narrow_stored = _run(path, monkeypatch, "auto")
    wide, wide_stored = _run(path, monkeypatch, "float32")
    assert narrow_stored == {(torch.float16, None)} and wide_stored == {(torch.float32, None)}
    assert narrow == wide


@needs_native
def test_only_weights_of_bfloat16_values_are_stored_so(monkeypatch):
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    assert holds_bfloat16(weight) and holds_bfloat16(weight, rows=5)  # any row split
    off = weight.clone()
    off[63, 47] = torch.nextafter(off[63, 47], torch.tensor(float("inf")))  # a float32 ulp off
    assert not holds_bfloat16(off) and not holds_bfloat16(off, rows=5)
    assert not holds_bfloat16(weight.double())
    halves = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).half().float()
    assert holds_float16(halves) and holds_float16(halves, rows=5)
    assert not holds_float16(off) and not holds_float16(halves * (1 + 2**-20))
    monkeypatch.setenv(WEIGHTS_ENV, "auto")
    assert pack_weight(weight, "native").data.dtype == torch.bfloat16
    assert pack_weight(off, "native").data.dtype == torch.float32
    monkeypatch.setenv(WEIGHTS_ENV, "float32")
    assert pack_weight(weight, "native").data.dtype == torch.float32
    monkeypatch.setenv(WEIGHTS_ENV, "bf16")
    with pytest.raises(ValueError, match=WEIGHTS_ENV):
        pack_weight(weight, "native")


@needs_native
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0", "Q5_0"])
def test_gguf_blocks_are_found_only_where_every_one_reproduces(kind, monkeypatch):
    """Blocks from gguf's own quantizer are found whatever rows the loader moved (and at any
    row split), Q4_0's and Q5_0's as Q8_0 blocks; one value a float32 ulp off, a row width
    that is no whole number of blocks, or plain float32 weights leave the weight in float32."""
    fmt = Q4_1 if kind == "Q4_1" else Q8_0
    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((70, 96)).astype(np.float32) * 0.05
    values[3] = 0  # a block of one value
    weight = torch.from_numpy(gguf.dequantize(gguf.quantize(values, qtype), qtype).copy())
    weight = weight[torch.randperm(70, generator=torch.Generator().manual_seed(0))]
    for rows in (4096, 9):
        q, d, m = find_blocks(weight, fmt, rows=rows)
        assert q.dtype == fmt.dtype and d.shape == m.shape == (70, 3)
        again = d.float().repeat_interleave(32, 1) * q.float()
        if fmt is Q4_1:
            again = again + m.float().repeat_interleave(32, 1)
        assert torch.equal(again.view(torch.int32), weight.view(torch.int32))
    off = weight.clone()
    off[69, 95] = torch.nextafter(off[69, 95], torch.tensor(float("inf")))
    assert find_blocks(off, fmt) is None and find_blocks(weight[:, :80], fmt) is None
    assert find_blocks(torch.randn(70, 96), fmt) is None
    if kind in ("Q4_0", "Q5_0"):  # their -0.0 values (d < 0 times q = 0) too
        assert (weight.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()
    monkeypatch.setenv(WEIGHTS_ENV, "auto")
    packed = pack_weight(weight, "native")
    assert _block_bytes(packed) == (20 if fmt is Q4_1 else 34)
    for rows in (1, 30):  # in registers, and widened into a float32 tile
        x = torch.randn(rows, 96)
        assert torch.equal(cpu_native.packed_linear(x, packed.few, 70, None),
                           cpu_native.packed_linear(x, packed.data, 70, None))
    assert pack_weight(off, "native").few is None
    monkeypatch.setenv(WEIGHTS_ENV, "float32")
    assert pack_weight(weight, "native").few is None
