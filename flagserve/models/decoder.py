"""One decoder for the Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

The differences between these architectures are config fields, not code paths worth separate
files: GQA, head_dim, qkv bias, q/k RMSNorm, tied embeddings and rope scaling.
"""
from collections.abc import Iterable
from functools import cached_property

import torch
from torch import nn

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.layers.attention import PagedAttention
from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flagserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from flagserve.layers.norm import RMSNorm
from flagserve.layers.rotary import RotaryEmbedding
from flagserve.models import native_layers
from flagserve.models.config import ModelConfig
from flagserve.models.weight_shapes import expected_shape
from kernels import KernelOps


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The contiguous range of decoder layers pipeline stage `pp_rank` runs (HF layer indices)."""
    return range(pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, par: ParallelContext):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias,
                                          par.tp_rank, par.tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.o_proj_bias,
                                        par.tp_rank, par.tp_size, par.tp_group)
        self.rotary = RotaryEmbedding(d, cfg.max_position_embeddings, cfg.rope, ops)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ops)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # Views into qkv, no copies: rotary works in place and every op takes strided inputs.
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # q/k norm (Qwen3), rotary and the KV-cache store run fused inside the attention layer.
        out = self.attn(q, k, v, meta, positions, self.rotary, self.q_norm, self.k_norm)
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, par: ParallelContext):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       cfg.mlp_bias, par.tp_rank, par.tp_size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                           par.tp_rank, par.tp_size, par.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, self.ops))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, par: ParallelContext):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, ops, par)
        self.mlp = DecoderMLP(cfg, ops, par)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """keep: the rows to return (all when None); the others still write their K/V."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, keep)
        if keep is not None:
            residual = residual[keep]
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

    def __init__(self, cfg: ModelConfig, ops: KernelOps, par: ParallelContext = ParallelContext()):
        """Builds this shard only: its stage's layers (the embedding on the first stage, the final
        norm and LM head on the last), each with its TP slice of the heads and columns."""
        super().__init__()
        self.config = cfg
        self.parallel = par
        self.layer_range = stage_layers(cfg.num_hidden_layers, par.pp_rank, par.pp_size)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par.tp_rank,
                                                    par.tp_size, par.tp_group)
                             if par.is_first_stage else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, par) for _ in self.layer_range)
        self.norm = self.lm_head = None
        if par.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, par.tp_rank, par.tp_size,
                                          par.tp_group)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first stage starts from token ids, later ones from the previous stage's (hidden,
        residual). Returns the final normed hidden states (and None) on the last stage, else
        (hidden, residual) for the next stage.

        keep (the last stage only; every stage has a layer, EngineArgs checks): the rows whose
        hidden states are returned, in its order. Only their logits are wanted, and the other
        rows' last use is their K/V in the last layer, so that layer's o_proj and MLP skip them:
        a prefill chunk's rows but its last (exact: every row is computed alone)."""
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
        native = self.native_layers
        if native is not None:
            hidden, residual = native(positions, hidden, residual, meta, keep)
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(positions, hidden, residual, meta, keep if i == last else None)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, None

    @cached_property
    def native_layers(self) -> native_layers.NativeLayers | None:
        """The layers as one native call, where they can (decided on the first forward: the
        weights are packed for the CPU after the model is built)."""
        cfg = self.config
        if not native_layers.supported(self.layers, self.parallel.tp_size, cfg.qk_norm):
            return None
        return native_layers.NativeLayers(self.layers, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The argmax of compute_logits(hidden) per row (among the tokens `bitmask` allows),
        without them where the LM head can (ParallelLMHead.greedy), else None."""
        return self.lm_head.greedy(hidden, bitmask)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def owns_weight(self, hf_name: str) -> bool:
        """Whether this shard's stage keeps the checkpoint tensor (asked before reading it)."""
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.layer_range
        if name.startswith("embed_tokens."):  # a tied LM head on a later stage reads it too
            return self.embed_tokens is not None or (
                self.lm_head is not None and self.config.tie_word_embeddings)
        if name.startswith(("norm.", "lm_head.")):
            return self.lm_head is not None
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...); tensors of other
        stages are skipped, TP slicing is each parameter's weight_loader. A tensor may be a
        torch.Tensor or a loader.CheckpointTensor: loaders read it only through narrow(),
        a row slice, or [:]."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        first_layer = self.layer_range.start
        for hf_name, tensor in weights:
            if not self.owns_weight(hf_name):
                continue
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            want = expected_shape(hf_name, self.config)
            if want is not None and tuple(tensor.shape) != want:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {list(tensor.shape)}, "
                                 f"but the model's config implies {list(want)}: the weights and "
                                 "the config are from different models")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                name = "lm_head.weight"  # tied embeddings, last stage without the embedding
            if name.startswith("layers."):  # HF layer index -> index within this stage
                _, index, rest = name.split(".", 2)
                name = f"layers.{int(index) - first_layer}.{rest}"
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
                param.data.copy_(tensor[:])
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
