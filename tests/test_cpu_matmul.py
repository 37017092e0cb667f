"""Packed weights for CPU linear layers, native and oneDNN (flagserve/layers/cpu_matmul.py)."""
import pytest
import torch
import torch.nn.functional as F

from flagserve.engine.cpu_model import pack_linear_weights
from flagserve.layers.cpu_matmul import bf16_supported, matmul_mode
from flagserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flagserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kernels import cpu_native

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
needs_native = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler for the native kernels")
needs_onednn_bf16 = pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not bf16_supported(),
                                       reason="no oneDNN bf16 path on this CPU (AVX2 only)")


def test_mode_auto_packs_cpu_float32_and_bfloat16_only(monkeypatch):
    monkeypatch.delenv("FLAGSERVE_CPU_MATMUL", raising=False)
    monkeypatch.delenv("FLAGSERVE_CPU_KERNELS", raising=False)
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    assert matmul_mode(CPU, torch.float32) == ("native" if cpu_native.available() else onednn)
    monkeypatch.setenv("FLAGSERVE_CPU_KERNELS", "torch")  # no native kernels: oneDNN's
    assert matmul_mode(CPU, torch.float32) == onednn
    # bf16 only where oneDNN has a bf16 path (packing raises on an AVX2-only CPU)
    assert matmul_mode(CPU, torch.bfloat16) == (onednn if bf16_supported() else "aten")
    assert matmul_mode(CPU, torch.float16) == "aten"
    assert matmul_mode(torch.device("cuda"), torch.float32) == "aten"
    assert matmul_mode(CPU, torch.float32, "aten") == "aten"


def test_mode_refuses_unknown_and_impossible(monkeypatch):
    monkeypatch.setenv("FLAGSERVE_CPU_MATMUL", "mkl")
    with pytest.raises(ValueError, match="FLAGSERVE_CPU_MATMUL"):
        matmul_mode(CPU, torch.float32)
    with pytest.raises(ValueError, match="needs a CPU model"):
        matmul_mode(torch.device("cuda"), torch.float32, "onednn")
    with pytest.raises(ValueError, match="native needs a CPU model in float32"):
        matmul_mode(CPU, torch.bfloat16, "native")


def _layers():
    torch.manual_seed(0)
    layers = [QKVParallelLinear(64, 16, 4, 2, bias=True), MergedColumnParallelLinear(64, [96, 96]),
              RowParallelLinear(192, 64), ParallelLMHead(1000, 64)]
    for layer in layers:
        for p in layer.parameters():
            p.data.normal_()
    return layers


@pytest.mark.parametrize("mode", [pytest.param("native", marks=needs_native),
                                  pytest.param("onednn", marks=needs_onednn)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_layers_match_f_linear_to_rounding(rows, mode):
    layers = _layers()
    inputs = [torch.randn(rows, layer.weight.shape[1]) for layer in layers]
    inputs[0] = torch.randn(3, rows, layers[0].weight.shape[1])  # any leading dims
    with torch.inference_mode():
        before = [layer(x) for layer, x in zip(layers, inputs)]
        assert pack_linear_weights(torch.nn.ModuleList(layers), mode) == 4
        after = [layer(x) for layer, x in zip(layers, inputs)]
    for layer, a, b in zip(layers, before, after):
        assert layer.packed is not None and layer.packed.mode == mode
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", [pytest.param("native", marks=needs_native),
                                  pytest.param("onednn", marks=needs_onednn)])
def test_a_tied_lm_head_keeps_the_embeddings_weight(mode):
    embed, head = VocabParallelEmbedding(100, 32), ParallelLMHead(100, 32)
    embed.weight.data.normal_()
    head.weight = embed.weight
    head.pack_for_cpu(mode)
    ids = torch.tensor([3, 99])
    torch.testing.assert_close(embed(ids), embed.weight[ids])
    torch.testing.assert_close(head(embed(ids)), F.linear(embed.weight[ids], embed.weight),
                               rtol=1e-5, atol=1e-4)


@needs_onednn_bf16
def test_bfloat16_packed_matches_within_bf16_rounding():
    torch.manual_seed(0)
    layer = RowParallelLinear(256, 128).to(torch.bfloat16)
    layer.weight.data.normal_()
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float())
    layer.pack_for_cpu("onednn")
    torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=0.5)
