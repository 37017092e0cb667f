"""A GGUF file as a model: its metadata as ModelConfig fields, its tensors under HF names.

llama.cpp's names and conventions are undone here, so the decoder loads a GGUF exactly as it
loads a safetensors checkpoint: `blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`, q/k rows
un-permuted for the "llama" architecture (convert_hf_to_gguf permutes them for its rotary
layout, as transformers' GGUF loader also undoes), quantized blocks dequantized by the `gguf`
package to float32. No torch here: config validation reads GGUF configs too.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import dequantize

from flagserve.layers.rope import RopeConfig
from flagserve.models.architectures import GGUF_ARCHITECTURES
from flagserve.models.gguf_reader import GGUFFile, read_gguf

ROPE_FREQS = "rope_freqs.weight"  # Llama-3 rope scaling as per-frequency divisors: config, not a weight
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MISSING = object()


def read_model_file(path: str | Path) -> GGUFFile:
    """The file, checked to hold an architecture we serve."""
    f = read_gguf(path)
    arch = f.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {str(path)!r}: architecture {arch!r} is not supported; "
                         f"supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)} "
                         "(Mistral files are 'llama')")
    return f


def _key(f: GGUFFile, name: str, default: Any = _MISSING) -> Any:
    """`{arch}.name` from the metadata; a list (one value per layer) must be uniform."""
    full = f"{f.metadata['general.architecture']}.{name}"
    value = f.metadata.get(full, default)
    if value is _MISSING:
        raise ValueError(f"GGUF file {str(f.path)!r} lacks metadata key {full!r}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF file {str(f.path)!r}: {full} varies per layer ({value[:8]}...), "
                             "which this engine does not support")
        value = value[0]
    return value


def _rope(f: GGUFFile, head_dim: int) -> RopeConfig:
    rotary = _key(f, "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"GGUF file {str(f.path)!r}: partial rotary ({rotary} of {head_dim} "
                         "dimensions) is not supported")
    theta = float(_key(f, "rope.freq_base", 10000.0))
    scaling = _key(f, "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"GGUF file {str(f.path)!r}: rope scaling {scaling!r} is not supported "
                         "(supported: none, linear, llama3 as rope_freqs)")
    factors = None
    if ROPE_FREQS in f.tensors:
        factors = tuple(float(x) for x in _dequantized(f, ROPE_FREQS))
        if len(factors) != head_dim // 2:
            raise ValueError(f"GGUF file {str(f.path)!r}: {ROPE_FREQS} has {len(factors)} "
                             f"factors, head_dim {head_dim} needs {head_dim // 2}")
    if scaling == "linear":
        return RopeConfig(theta, "linear", factor=float(_key(f, "rope.scaling.factor")),
                          freq_factors=factors)
    return RopeConfig(theta, freq_factors=factors)


def _end_of_generation_ids(f: GGUFFile) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):  # llama.cpp stops on each of those it is given
        token = f.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None and token not in ids:
            ids.append(token)
    return tuple(ids)


def gguf_config_fields(path: str | Path) -> dict[str, Any]:
    """ModelConfig's fields, from the file's metadata and which tensors it has."""
    f = read_model_file(path)
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"GGUF file {str(path)!r} has no token_embd.weight tensor")
    hidden, heads = _key(f, "embedding_length"), _key(f, "attention.head_count")
    head_dim = _key(f, "attention.key_length", hidden // heads)
    arch = GGUF_ARCHITECTURES[f.metadata["general.architecture"]]
    return dict(
        architecture=arch,
        vocab_size=f.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=_key(f, "feed_forward_length"),
        num_hidden_layers=_key(f, "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_key(f, "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(_key(f, "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=_key(f, "context_length"),
        rope=_rope(f, head_dim),
        # llama.cpp writes the output projection only when it is not the embedding.
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        o_proj_bias="blk.0.attn_output.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        torch_dtype="float32",  # what dequantization gives, whatever the file stores
        eos_token_ids=_end_of_generation_ids(f),
        bos_token_id=f.metadata.get("tokenizer.ggml.bos_token_id"),
        checkpoint_format="gguf",
    )


def gguf_param_count(path: str | Path) -> int:
    """Parameters after dequantization (what `action=plan` sizes the weights by)."""
    f = read_gguf(path)
    return sum(math.prod(t.shape) for name, t in f.tensors.items() if name != ROPE_FREQS)


def gguf_weight_bytes(path: str | Path) -> int:
    """The file's weights in bytes, as stored (quantized blocks at their own size)."""
    f = read_gguf(path)
    return sum(t.nbytes for name, t in f.tensors.items() if name != ROPE_FREQS)


def gguf_cpu_block_bytes(path: str | Path) -> int:
    """Bytes of the blocks the native CPU linear keeps beside the float32 weights
    (flagserve/layers/cpu_quantized.py): Q4_1 tensors as stored, Q8_0, Q4_0 and Q5_0 ones as
    Q8_0 blocks (34 bytes per 32 weights)."""
    tensors = read_gguf(path).tensors.values()
    q4_1 = sum(t.nbytes for t in tensors if t.ggml_type.name == "Q4_1")
    q8_0 = sum(math.prod(t.shape) for t in tensors if t.ggml_type.name in ("Q8_0", "Q4_0", "Q5_0"))
    return q4_1 + q8_0 * 34 // 32


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> the HF checkpoint name DecoderForCausalLM.load_weights takes."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        ours = _LAYER.get(part)
        name = ours and f"model.layers.{layer}.{ours}"
    else:
        name = _TOP.get(stem)
    if name is None or kind not in ("weight", "bias"):
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the decoder "
                         f"(known: {', '.join(_TOP)}, blk.N.{{{', '.join(_LAYER)}}})")
    return f"{name}.{kind}"


def _dequantized(f: GGUFFile, name: str) -> np.ndarray:
    info = f.tensors[name]
    try:
        values = dequantize(f.data(info), info.ggml_type)
    except NotImplementedError:
        raise ValueError(f"GGUF file {str(f.path)!r}: tensor {name!r} is stored as "
                         f"{info.ggml_type.name}, which the gguf package cannot dequantize") from None
    values = values.reshape(info.shape)
    return values if values.flags.writeable else values.copy()  # F32 comes as a read-only view


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation (each head's rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(path: str | Path, keep: Callable[[str], bool] = lambda _: True
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) of every tensor `keep` wants; the others are never dequantized."""
    f = read_model_file(path)
    permuted = f.metadata["general.architecture"] == "llama"
    heads = _key(f, "attention.head_count")
    kv_heads = _key(f, "attention.head_count_kv", heads)
    for name in f.tensors:
        if name == ROPE_FREQS:
            continue
        target = hf_name(name)
        if not keep(target):
            continue
        values = _dequantized(f, name)
        if permuted and ".attn_q." in name:
            values = _unpermute(values, heads)
        elif permuted and ".attn_k." in name:
            values = _unpermute(values, kv_heads)
        yield target, values
