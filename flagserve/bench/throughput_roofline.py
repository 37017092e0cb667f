"""The floor of a workload: the least time any engine could take on it, on this device.

Two bounds, each met by no engine and the larger one taken. Bandwidth: each step reads every
weight once, and each decoded token reads the K and V of its whole context, so (steps x
weight bytes + KV bytes) / bandwidth: what bounds decoding. Compute: every token fed through
the model costs its matmuls' FLOPs (the layers' linears and attention over its context) and
every output token the LM head's, so FLOPs / the device's matmul rate: what bounds prefill,
and on a CPU decoding batches of more than a few dozen rows. The achieved ratio is floor /
measured time (1.0 = at the roofline).
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


def matmul_flops(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> int:
    """FLOPs a workload's matmuls take at least: a request's prompt and every output token but
    the last go through the layers (a token at position t attends to t + 1), each output
    token through the LM head. Norms, activations and the embedding's row reads are not
    counted: a floor."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    linears = h * d * (2 * heads + 2 * kv_heads) + 3 * h * i  # q, k, v, o; gate, up, down
    fed = positions = 0
    for p, o in zip(prompt_lens, output_lens):
        n = p + max(o - 1, 0)
        fed += n
        positions += n * (n + 1) // 2  # keys attended, summed over the fed tokens
    attention = 2 * heads * d  # q.k and p.v per key, per layer
    layers = cfg.num_hidden_layers * (fed * linears + positions * attention)
    return 2 * (layers + sum(output_lens) * cfg.vocab_size * h)


def compute_floor_seconds(flops: int, peak_tflops: float) -> float:
    return flops / (peak_tflops * 1e12)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth_gbs(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Device memory bandwidth from a large copy (it reads and writes every byte), the best of
    `repeats` as the matmul rate below: a floor from an average under load can sit above what
    the run then achieves."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch, outside the timing
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                        repeats: int = 5) -> float:
    """The device's matmul rate in `dtype`: a square product of the vendor's BLAS (oneDNN or
    MKL on a CPU, cuBLAS on a GPU), the best of `repeats`: near the chip's FMA peak."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # first call: the library's set-up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12
