"""The shape each checkpoint tensor must have, from the model's config, as transformers builds
the model: a checkpoint that disagrees with its config is refused by name, where the weight
loaders' narrow() and copy_() would cut it to fit or broadcast it and serve wrong numbers."""
from __future__ import annotations

from flagserve.models.config import ModelConfig


def expected_shape(hf_name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """(rows, columns) or (size,) of an HF-named tensor; None for a name not listed here."""
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        name = name.split(".", 2)[2]
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    matrices = {"embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h),
                "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
                "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
                "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    vectors = {"norm": h, "input_layernorm": h, "post_attention_layernorm": h,
               "self_attn.q_norm": d, "self_attn.k_norm": d}
    module, _, kind = name.rpartition(".")
    if module in matrices:
        rows, columns = matrices[module]
        return (rows, columns) if kind == "weight" else (rows,)
    if module in vectors:
        return (vectors[module],)
    return None
