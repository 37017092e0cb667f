"""Model shapes to benchmark without their checkpoints: a config and a tokenizer, no weights.

The engine draws random weights on the device (EngineArgs.load_format="dummy"), so an 8B
shape needs no 16-32 GB file and loads in seconds. The tokenizer is the tiny test one: a
benchmark sends token ids, drawn within its vocabulary (prompts past it are refused, as vLLM
does); sampled ids past it decode to nothing.
"""
import json
from pathlib import Path
from typing import Literal, get_args

Shape = Literal["qwen3-0.6b", "llama3-8b"]

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B's config.json
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
        "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "llama3-8b": {  # meta-llama/Meta-Llama-3-8B's config.json
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
        "tie_word_embeddings": False, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    },
}
assert set(PRESETS) == set(get_args(Shape))


def write_shape(shape: Shape, out_dir: str | Path, num_layers: int | None = None) -> str:
    """A model directory of `shape` (num_layers: fewer layers, e.g. for a quick run) holding
    config.json and a tokenizer only; serve it with load_format="dummy"."""
    from flagserve.models.tiny import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(PRESETS[shape])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    arch = "qwen3" if config["model_type"] == "qwen3" else "llama"
    build_tokenizer(arch, model_max_length=config["max_position_embeddings"]).save_pretrained(out)
    return str(out)
