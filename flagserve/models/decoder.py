"""One decoder for the Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

The differences between these architectures are config fields, not code paths worth separate
files: GQA, head_dim, qkv bias, q/k RMSNorm, tied embeddings and rope scaling.
"""
from collections.abc import Iterable

import torch
from torch import nn

from flagserve.layers.attention import PagedAttention
from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flagserve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from flagserve.layers.norm import RMSNorm
from flagserve.layers.rotary import RotaryEmbedding
from flagserve.models.config import ModelConfig
from kernels import KernelOps


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, tp_rank: int, tp_size: int):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, tp_rank, tp_size)
        self.rotary = RotaryEmbedding(d, cfg.max_position_embeddings, cfg.rope, ops)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ops)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.contiguous(), k.contiguous()
        self.rotary(positions, q, k)
        out = self.attn(q, k, v.contiguous(), meta)
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, tp_rank: int, tp_size: int):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       cfg.mlp_bias, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                           tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, tp_rank: int, tp_size: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, ops, tp_rank, tp_size)
        self.mlp = DecoderMLP(cfg, ops, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    # HF checkpoint names of the projections that live fused in one of our weights.
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, ops: KernelOps, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, tp_rank, tp_size)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard_id = None
            for hf_part, (ours, shard) in self.packed_modules.items():
                if f".{hf_part}." in name:
                    name, shard_id = name.replace(f".{hf_part}.", f".{ours}."), shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
