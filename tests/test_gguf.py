"""GGUF as a model format, on the tiny models of every architecture written as GGUF files in
F32, F16, Q8_0 and Q4_1 (tests/gguf_files.py): metadata read as the HF config, greedy tokens
equal to transformers on the same dequantized weights, logprobs within 1e-3, clear errors on
bad files."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flagserve import LLM, SamplingParams
from flagserve.models.architectures import ARCHS
from flagserve.models.config import auto_dtype, load_model_config
from flagserve.models.gguf import gguf_cpu_block_bytes, gguf_param_count
from flagserve.models.tokenizer import gguf_tokenizer_cache_dir, load_tokenizer
from tests.gguf_files import WeightType, write_gguf
from tests.hf_referee import hf_greedy
from tests.serve.conftest import run_py
from tests.serve.test_config import run as plan
from tests.test_shard_weights import shard, split_qkv

NEW_TOKENS = 32
PROMPTS = [
    "Hello",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 and then",
    "In the kitchen we cook rice and beans with salt, pepper and a lot of patience, because "
    "the recipe needs time. Meanwhile the old computer in the corner compiles code.",
]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """GGUF tokenizers are cached; keep this module's out of the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLAGSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def gguf_model(tiny_model_factory, tmp_path_factory):
    """gguf_model(arch, weight_type) -> (HF directory, GGUF file written from it)."""
    out = tmp_path_factory.mktemp("gguf")

    def make(arch: str, weight_type: WeightType = "F32") -> tuple[str, str]:
        hf_dir = tiny_model_factory(arch)
        path = out / f"tiny-{arch}-{weight_type}.gguf"
        if not path.exists():
            write_gguf(hf_dir, path, weight_type)
        return hf_dir, str(path)

    return make


def transformers_on_gguf(hf_dir: str, path: str):
    """transformers' own GGUF loader (its dequantize, its q/k un-permute) reads the weights.
    The config comes from the HF directory the file was written from: transformers' GGUF
    config reader drops an explicit head_dim (Qwen3) and Llama-3 rope scaling (rope_freqs).
    Mistral is written as "llama" (as llama.cpp does), which it loads correctly by itself."""
    config = AutoConfig.from_pretrained(hf_dir)
    kwargs = {} if config.model_type == "mistral" else {"config": config}
    file = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(arch, weight_type, gguf_model):
    hf_dir, path = gguf_model(arch, weight_type)
    llm = LLM(path, attention_backend="torch", max_num_seqs=4)  # dtype auto: float32 on CPU
    assert llm.llm_engine.executor.runner.dtype == torch.float32
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # The file's tokenizer is the HF directory's: same ids, BOS included where Llama adds it.
    assert prompts == [load_tokenizer(hf_dir).encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    reference = hf_greedy(transformers_on_gguf(hf_dir, path), prompts, NEW_TOKENS)
    for out, (tokens, logprobs) in zip(outs, reference):
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(comp.logprobs, comp.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(PROMPTS)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_comes_from_the_metadata(arch, gguf_model):
    hf_dir, path = gguf_model(arch, "Q8_0")
    ours, hf = load_model_config(path), load_model_config(hf_dir)
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "bos_token_id")
    assert {f: getattr(ours, f) for f in same} == {f: getattr(hf, f) for f in same}
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as float32
    assert ours.architecture == ("LlamaForCausalLM" if arch == "mistral" else hf.architecture)
    assert ours.eos_token_ids == (hf.eos_token_ids[0],)  # the file names one EOS
    assert ours.checkpoint_format == "gguf"
    # Llama-3 rope scaling arrives as llama.cpp's per-frequency factors.
    assert (ours.rope.freq_factors is not None) == (hf.rope.rope_type == "llama3")
    assert (auto_dtype(ours, on_gpu=False), auto_dtype(ours, on_gpu=True)) == ("float32", "bfloat16")


def test_tokenizer_is_built_once_then_cached(gguf_model):
    _, path = gguf_model("qwen2", "F16")
    cached = gguf_tokenizer_cache_dir(Path(path))
    shutil.rmtree(cached, ignore_errors=True)
    first = load_tokenizer(path)
    assert (cached / "tokenizer.json").is_file()
    again = load_tokenizer(path)
    messages = [{"role": "user", "content": "Hi there"}]
    for tok in (first, again):
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert [again.encode(p) for p in PROMPTS] == [first.encode(p) for p in PROMPTS]


def _bad_files(tmp_path: Path, good: str) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error must say)."""
    data = Path(good).read_bytes()
    files = {"missing": (tmp_path / "missing.gguf", "does not exist"),
             "truncated": (tmp_path / "truncated.gguf", "truncated: tensor"),
             "cut_header": (tmp_path / "cut_header.gguf", "truncated or corrupt"),
             "not_gguf": (tmp_path / "not_gguf.gguf", "not a GGUF file"),
             "gpt2": (tmp_path / "gpt2.gguf", "architecture 'gpt2' is not supported")}
    files["truncated"][0].write_bytes(data[:len(data) // 2])
    files["cut_header"][0].write_bytes(data[:200])
    files["not_gguf"][0].write_bytes(b"PK\x03\x04" + data[4:1000])
    import gguf
    writer = gguf.GGUFWriter(files["gpt2"][0], "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files


@pytest.mark.parametrize("case", ["missing", "truncated", "cut_header", "not_gguf", "gpt2"])
def test_bad_file_is_one_clear_error(case, gguf_model, tmp_path):
    path, words = _bad_files(tmp_path, gguf_model("llama", "Q8_0")[1])[case]
    with pytest.raises(ValueError) as err:
        LLM(str(path))
    assert str(path) in str(err.value) and words in str(err.value)
    if case == "gpt2":  # names what is supported; its tokenizer may still serve another model
        assert "llama, qwen2, qwen3" in str(err.value)
        return
    with pytest.raises(ValueError, match=words):
        load_tokenizer(str(path))


def test_plan_sizes_the_dequantized_weights(gguf_model, capsys):
    _, path = gguf_model("qwen3", "Q8_0")
    code, out, err = plan(capsys, f"serve.llm.engine_args.model={path}")
    assert code == 0, err
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        gguf_model("qwen3")[0]).parameters())
    assert gguf_param_count(path) == params
    assert "(Qwen3ForCausalLM, float32," in out
    blocks = gguf_cpu_block_bytes(path)  # kept for decode steps on CPU
    assert 0 < blocks < params * 4 / 3
    assert f"weights   {(params * 4 + blocks) / 2**20:.1f} MiB" in out  # dequantized to float32
    assert "KV cache" in out and "tokens at 1.0 KiB/token" in out  # 2 layers x 2 x 2 heads x 32 x 4 B


def test_bad_file_is_a_config_error_in_run_py(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 10))  # 10 keys promised, none there
    result = run_py(f"serve.llm.engine_args.model={bad}", "action=plan", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "`serve.llm.engine_args.model`" in result.stderr and str(bad) in result.stderr
    assert "truncated or corrupt" in result.stderr and "Traceback" not in result.stderr


def test_tensor_parallel_shards_slice_the_dequantized_weights(gguf_model):
    """TP ranks cut their slice from whole dequantized tensors (blocks are not column-sliceable);
    un-permuted q/k rows must land in the right heads of each rank."""
    _, path = gguf_model("llama", "Q8_0")
    full = shard(path)
    ranks = [shard(path, tp_rank=r, tp_size=2) for r in range(2)]
    for i, layer in enumerate(full.layers):
        for j, whole in enumerate(split_qkv(layer.self_attn)):
            assert torch.equal(torch.cat([split_qkv(m.layers[i].self_attn)[j] for m in ranks]), whole)
    last = shard(path, pp_rank=1, pp_size=2)  # stage 1 of 2: layer 1, the norm and the LM head
    assert torch.equal(last.layers[0].self_attn.qkv_proj.weight, full.layers[1].self_attn.qkv_proj.weight)
    assert torch.equal(last.lm_head.weight, full.lm_head.weight)
