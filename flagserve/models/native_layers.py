"""A step's decoder layers as one native call on CPU (kernels/csrc/cpu_decoder_layers.cpp).

The Python layers call one kernel after another; between them their own code and torch's
dispatcher run cold (the kernel before streamed its weights or KV cache through L2), 30-100
us per op: ~12% of a 4-row decode step (docs/performance.md, CPU). The native call runs the
same kernels in the same order, so its outputs are the Python path's exactly. It runs every
step (decodes, prompt chunks, both) when the layers run the native float32 kernels with
TP = 1 and no q/k norm; FLAGSERVE_CPU_NATIVE_LAYERS=off keeps the Python path.
"""
from __future__ import annotations

import torch
from torch import nn

from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.cpu_matmul import FEW_ROWS
from kernels import cpu_native
from kernels.env import NATIVE_LAYERS_ENV, Switch, env_choice

NATIVE_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_store_kvcache",
              "paged_decode_attention", "paged_prefill_attention")


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def supported(layers: nn.ModuleList, tp_size: int, qk_norm: bool) -> bool:
    """Whether these layers can run as one native call (checked once, after packing)."""
    if env_choice(NATIVE_LAYERS_ENV, Switch, "on") == "off" or tp_size != 1 or qk_norm:
        return False
    if len(layers) == 0 or not cpu_native.available():
        return False
    for layer in layers:
        ops = layer.self_attn.attn.ops
        if any(getattr(ops, name) is not getattr(cpu_native, f"{name}_cpu") for name in NATIVE_OPS):
            return False  # the reference ops, or inductor's (FLAGSERVE_CPU_COMPILE)
        if ops.prefill_attention is not None:
            return False  # whole prompts over their own rows: not what the native call runs
        if any(lin.packed is None or lin.packed.mode != "native" for lin in _linears(layer)):
            return False
    return True


class NativeLayers:
    def __init__(self, layers: nn.ModuleList, eps: float):
        self.layers = layers
        attn = layers[0].self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                      layers[0].mlp.gate_up_proj.packed.out_features // 2)
        self.eps = eps
        # per kind of step (few rows or not: PackedWeight.for_rows), made once
        self._args: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {}
        self._cache: torch.Tensor | None = None  # the first layer's K cache when _args were made

    def _weights(self, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        attn0 = self.layers[0].self_attn.attn
        if self._cache is not attn0.k_cache:  # caches bound (again)
            self._args, self._cache = {}, attn0.k_cache
        few = rows <= FEW_ROWS
        if few not in self._args:
            weights, biases = [], []
            for layer in self.layers:
                linears = _linears(layer)
                qkv, o, gate_up, down = (lin.packed.for_rows(rows) for lin in linears)
                cache = layer.self_attn.attn
                weights += [layer.input_layernorm.weight, qkv, o,
                            layer.post_attention_layernorm.weight, gate_up, down,
                            cache.k_cache, cache.v_cache]
                biases += [lin.bias for lin in linears]
            self._args[few] = (weights, biases)
        return self._args[few]

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, meta: AttentionMetadata,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward over all the layers; keep as there (the last layer's rows)."""
        weights, biases = self._weights(hidden.shape[0])
        self_attn = self.layers[0].self_attn
        return torch.ops.flagserve_cpu.decoder_layers(
            hidden, residual, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, meta.num_decode_tokens, keep, self_attn.rotary.cos_sin_cache,
            weights, biases, *self.shape, self.eps, self_attn.attn.scale)
