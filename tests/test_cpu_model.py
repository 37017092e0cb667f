"""What a CPU engine's model gets after loading (flagserve/engine/cpu_model.py): the native
kernels where they build, the torch reference when asked for. Greedy parity with
transformers on the native path: tests/test_hf_parity.py (CPU engines take it by default)."""
import pytest

from flagserve import LLM
from kernels import cpu_native


def attention_ops_name(llm: LLM) -> str:
    return llm.llm_engine.executor.runner.model.layers[0].self_attn.attn.ops.name


@pytest.mark.skipif(not cpu_native.available(), reason="needs a C++ compiler")
def test_cpu_engine_runs_the_native_kernels(llama_path, monkeypatch):
    monkeypatch.delenv(cpu_native.KERNELS_ENV, raising=False)
    assert attention_ops_name(LLM(llama_path, dtype="float32", device="cpu")) == "torch+cpu-native"
    monkeypatch.setenv(cpu_native.KERNELS_ENV, "torch")
    assert attention_ops_name(LLM(llama_path, dtype="float32", device="cpu")) == "torch"
