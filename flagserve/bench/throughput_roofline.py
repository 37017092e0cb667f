"""The bandwidth floor of a decode workload: the least time any engine could take on it.

Decoding is memory-bound: each step reads every weight once, and each decoded token reads the
K and V of its whole context. Floor = (steps x weight bytes + KV bytes) / bandwidth; the
achieved ratio is floor / measured time (1.0 = at the roofline). FLOPs are not counted, so for
large prefills the floor is loose.
"""
import time

import torch

from flagserve.models.config import ModelConfig


def weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Weights one forward reads: every layer's matrices and norms, the final norm, the LM head
    (a tied head is the embedding, read once here; the embedding lookup reads only its rows)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    layer = attn + 3 * h * i + 2 * h
    return elem * (cfg.num_hidden_layers * layer + cfg.vocab_size * h + h)


def kv_bytes_per_token(cfg: ModelConfig, elem: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem


def kv_bytes(prompt_lens: list[int], output_lens: list[int], per_token: int) -> int:
    """KV bytes a workload reads at least: each prompt's once (its prefill), and for output
    token j >= 1 of a P-token prompt the P + j tokens before it (token 0 comes from prefill)."""
    tokens = 0
    for p, o in zip(prompt_lens, output_lens):
        decodes = max(o - 1, 0)
        tokens += p + decodes * p + decodes * (decodes + 1) // 2
    return tokens * per_token


def floor_seconds(steps: int, weights: int, kv: int, bandwidth_gbs: float) -> float:
    return (steps * weights + kv) / (bandwidth_gbs * 1e9)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth_gbs(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Device memory bandwidth from a large copy (it reads and writes every byte)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch, outside the timing
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9
