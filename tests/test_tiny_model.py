"""The built-in tiny model: loadable by transformers, per-arch features, tokenizer, determinism."""
from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from flagserve.models import tiny

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ADDS_BOS = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False}
TEXTS = [
    "Hello world! The weather today is 18 degrees.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "Ünïcödé café, naïve façade — “quotes” …",
    "decomposed cafe\u0301 and precomposed caf\u00e9",
    "日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 🙂👍🏽🇫🇷 and a zero-width joiner 👩‍💻",
    "control \x00\x07\x1b chars and a BOM \ufeff",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    "3.14159 + 2,718 = 5,859.14159; $3.20 (100%)",
    "",
]
PROMPTS = [
    "The weather today",
    "Open the terminal and",
    "Two plus two is",
    "My grandmother always said",
    "Where is the nearest",
    "She plays the piano",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny.make_tiny_model(root / arch, arch=arch, seed=0) for arch in tiny.ARCHS}


@cache
def load(path: str):
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def file_hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_loads_and_runs_in_transformers(arch, model_dirs):
    path = model_dirs[arch]
    assert {p.name for p in path.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    }
    tok, model = load(str(path))
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert model.dtype == torch.float32
    cfg = model.config
    assert cfg.vocab_size == len(tok) == tiny.VOCAB_SIZE
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # GQA
    assert cfg.max_position_embeddings == 2048
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 4)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 4)
    assert tok.convert_tokens_to_ids([tiny.IM_START, tiny.IM_END]) == [2, 3]
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, [1, 3], 4)

    ids = tok(["The weather today is", "Open the terminal"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape[:2] == ids.input_ids.shape and logits.shape[-1] == tiny.VOCAB_SIZE
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_architecture_specifics(arch, model_dirs):
    path = model_dirs[arch]
    _, model = load(str(path))
    cfg = model.config
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == [ARCH_CLASSES[arch]]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())

    tied = arch == "qwen2"
    assert cfg.tie_word_embeddings is tied and raw["tie_word_embeddings"] is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    assert ("lm_head.weight" in keys) is not tied

    rope = cfg.rope_parameters
    assert raw["rope_theta"] == rope["rope_theta"]  # legacy spelling written alongside
    if arch == "llama":
        assert rope == {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        assert raw["rope_scaling"]["rope_type"] == "llama3"
    else:
        assert rope["rope_type"] == "default" and rope["rope_theta"] == 1000000.0
        assert raw["rope_scaling"] is None

    attn = model.model.layers[0].self_attn
    if arch == "qwen3":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
        assert tuple(attn.q_proj.weight.shape) == (4 * 32, 64)
        assert tuple(attn.k_proj.weight.shape) == (2 * 32, 64)
        assert "model.layers.0.self_attn.q_norm.weight" in keys
    else:  # head_dim 16; Qwen2's config has no head_dim field at all
        assert tuple(attn.q_proj.weight.shape) == (4 * 16, 64)
        assert tuple(attn.k_proj.weight.shape) == (2 * 16, 64)
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    if arch in ("mistral", "qwen2", "qwen3"):
        assert cfg.sliding_window is None


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_tokenizer_round_trips_any_text(arch, model_dirs):
    path = model_dirs[arch]
    tok, _ = load(str(path))
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))  # what a tokenizers-only reader sees
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids, text
        body = ids[1:] if ADDS_BOS[arch] else ids
        assert (ids[:1] == [tiny.BOS_ID]) is ADDS_BOS[arch]
        assert tiny.BOS_ID not in body
        # Qwen normalizes to NFC (as transformers' Qwen2Tokenizer does); the rest is lossless.
        expected = unicodedata.normalize("NFC", text) if arch in ("qwen2", "qwen3") else text
        assert tok.decode(body) == expected
        assert tok.decode(ids, skip_special_tokens=True) == expected.replace(
            tiny.IM_START, "").replace(tiny.IM_END, "")
    # Special tokens in text are single ids; byte-level means no unknown token exists.
    assert tok("<|im_start|>x<|im_end|>", add_special_tokens=False).input_ids[::2] == [2, 3]
    assert tok.unk_token is None
    assert max(max(tok(t).input_ids, default=0) for t in TEXTS) < tiny.VOCAB_SIZE


def test_token_ids_are_pinned(model_dirs):
    """Changing the corpus or tokenizer recipe changes every expected output in the project:
    do it on purpose, bump cache.RECIPE_VERSION and update these ids."""
    llama, _ = load(str(model_dirs["llama"]))
    qwen, _ = load(str(model_dirs["qwen2"]))
    text = "The weather today is 18 degrees."
    assert llama(text).input_ids == [0, 298, 1386, 730, 304, 561, 491, 18]
    assert qwen(text).input_ids == [298, 1342, 707, 304, 225, 21, 28, 482, 18]  # digits split


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_chat_template(arch, model_dirs):
    path = model_dirs[arch]
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    tok, _ = load(str(path))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tiny.BOS_TOKEN if ADDS_BOS[arch] else ""
    assert text == (
        f"{bos}<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather?<|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("And tomorrow?<|im_end|>\n")
    # The template carries the BOS itself, so it appears exactly once in the encoded prompt.
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tiny.BOS_ID) == int(ADDS_BOS[arch])
    assert ids[int(ADDS_BOS[arch])] == tiny.IM_START_ID and ids.count(tiny.IM_END_ID) == 4


def test_same_seed_same_bytes_other_seed_other_weights(model_dirs, tmp_path):
    again = tiny.make_tiny_model(tmp_path / "again", arch="llama", seed=0)
    assert file_hashes(again) == file_hashes(model_dirs["llama"])
    other = tiny.make_tiny_model(tmp_path / "other", arch="llama", seed=1)
    a, b = file_hashes(model_dirs["llama"]), file_hashes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"}  # the seed only moves weights
    with safe_open(str(model_dirs["llama"] / "model.safetensors"), "pt") as f0, \
            safe_open(str(other / "model.safetensors"), "pt") as f1:
        for key in f0.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
            if "norm" not in key:
                assert not torch.allclose(f0.get_tensor(key), f1.get_tensor(key)), key


def test_cli_writes_the_same_model_in_a_fresh_process(model_dirs, tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "flagserve.models.tiny", str(out), "--arch", "qwen3", "--seed", "0"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout.strip() == str(out)
    assert file_hashes(out) == file_hashes(model_dirs["qwen3"])  # deterministic across processes


def test_overrides(tmp_path):
    path = tiny.make_tiny_model(
        tmp_path / "big", arch="llama", num_hidden_layers=3, hidden_size=128,
        tie_word_embeddings=True, max_position_embeddings=512,
    )
    tok, model = load(str(path))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (3, 128, 32)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 512 == tok.model_max_length
    with torch.no_grad():
        assert torch.isfinite(model(**tok("hi", return_tensors="pt")).logits).all()
    with pytest.raises(ValueError, match="vocab_size"):
        tiny.build_config("llama", vocab_size=100)
    with pytest.raises(ValueError, match="arch"):
        tiny.make_tiny_model(tmp_path / "x", arch="gpt2")


def test_ensure_tiny_model_builds_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGSERVE_CACHE", str(tmp_path / "cache"))
    target = tiny.default_model_dir("llama")
    assert target.parent == tmp_path / "cache" and "llama" in target.name
    real_make = tiny.make_tiny_model

    def lose_the_race(out, arch="llama", **kw):
        """Another process publishes the model while this one is still building its copy."""
        real_make(out, arch=arch, **kw)
        real_make(target, arch=arch, **kw)
        return Path(out)

    monkeypatch.setattr(tiny, "make_tiny_model", lose_the_race)
    assert tiny.ensure_tiny_model() == target
    monkeypatch.setattr(tiny, "make_tiny_model", real_make)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp dir left behind

    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert file_hashes(target) == file_hashes(tiny.make_tiny_model(tmp_path / "ref"))

    explicit = tiny.ensure_tiny_model(tmp_path / "q3", arch="qwen3")
    assert json.loads((explicit / "config.json").read_text())["model_type"] == "qwen3"
    (tmp_path / "half").mkdir()
    with pytest.raises(FileExistsError):
        tiny.ensure_tiny_model(tmp_path / "half")


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_model_is_decisive_and_not_degenerate(arch, model_dirs):
    """Greedy token-exact comparisons need clear argmax winners, and tests need continuations
    that depend on the prompt instead of one token repeated forever."""
    tok, model = load(str(model_dirs[arch]))
    margins, continuations = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                 pad_token_id=tiny.PAD_ID)
            logits = model(out).logits[0]
        top2 = logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        new = out[0, ids.shape[1]:].tolist()
        continuations.append(tuple(new))
        assert len(set(new)) >= 10, (prompt, tok.decode(new))
        assert max(len(list(run)) for _, run in itertools.groupby(new)) <= 8, tok.decode(new)
    assert len(set(continuations)) == len(PROMPTS)

    margin = torch.cat(margins)
    assert margin.median() > 0.3, margin.median()
    assert (margin < 0.05).float().mean() < 0.12
    assert 2.0 < logits.std() < 8.0  # a healthy spread, nowhere near fp16 limits

    # fp16 stays tame: no overflow, same greedy choices on this sequence.
    fp16 = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float16)
    with torch.no_grad():
        half = fp16(out, output_hidden_states=True)
    assert max(h.abs().max().item() for h in half.hidden_states) < 100
    assert torch.isfinite(half.logits).all()
    agree = (half.logits[0].float().argmax(-1) == logits.argmax(-1)).float().mean()
    assert agree > 0.9
