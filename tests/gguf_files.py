"""GGUF files for the tests, written from the tiny HF models the way llama.cpp's
convert_hf_to_gguf writes them: its metadata keys, gguf's own tensor-name map, q/k rows
permuted for the "llama" architecture (Llama and Mistral), Llama-3 rope scaling as a
rope_freqs tensor, 1-D tensors in F32 and the rest in the chosen type (Q4_1: the token
embedding in Q8_0, as in SmolLM2's file).

Independent of flagserve.models.gguf on purpose: the reader is tested against a writer that
shares none of its tables.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from safetensors.numpy import load_file

WeightType = Literal["F32", "F16", "Q8_0", "Q4_1"]
_FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
               "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}


def write_gguf(hf_dir: str | Path, out: str | Path, weight_type: WeightType = "F32") -> Path:
    """Convert the tiny HF model in `hf_dir` into the GGUF file `out`."""
    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "llama" if cfg["model_type"] in ("llama", "mistral") else cfg["model_type"]
    writer = gguf.GGUFWriter(out, arch)
    _write_hparams(writer, cfg, weight_type)
    _write_tokenizer(writer, hf_dir, add_bos=arch == "llama")
    for name, values, qtype in _tensors(hf_dir, cfg, arch, weight_type):
        writer.add_tensor(name, values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hparams(w: gguf.GGUFWriter, cfg: dict, weight_type: WeightType) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(f"tiny {cfg['model_type']}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    if "head_dim" in cfg and head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(_FILE_TYPES[weight_type])


def _write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, add_bos: bool) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2" if add_bos else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(special[tok_cfg["bos_token"]])
    w.add_eos_token_id(special[tok_cfg["eos_token"]])
    w.add_pad_token_id(special[tok_cfg["pad_token"]])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(tok_cfg["chat_template"])


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(hf_dir: Path, cfg: dict, arch: str, weight_type: WeightType):
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    rope_freqs = _llama3_rope_factors(cfg)
    if rope_freqs is not None:
        yield "rope_freqs.weight", rope_freqs, None
    for hf_name, values in sorted(load_file(hf_dir / "model.safetensors").items()):
        values = values.astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            values = _permute(values, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            values = _permute(values, cfg["num_key_value_heads"])
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        embedding_q4_1 = weight_type == "Q4_1" and name == "token_embd.weight"
        yield name, *_encoded(values, "Q8_0" if embedding_q4_1 else weight_type)


def _encoded(values: np.ndarray, weight_type: WeightType):
    if values.ndim == 1 or weight_type == "F32":
        return values, None
    if weight_type == "F16":
        return values.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[weight_type]
    return gguf.quantize(values, qtype), qtype


def _llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors."""
    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    heads = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / rope["low_freq_factor"], old_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)
