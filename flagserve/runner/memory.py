"""Memory per device of one engine shard: weights, and the KV cache capacity in tokens.

Counts parameters from the safetensors headers or the GGUF tensor table (exact, reads a few
KB per file; GGUF weights count as dequantized to the engine's dtype, and on CPU their Q4_1,
Q8_0, Q4_0 and Q5_0 blocks once more, which decode steps read: flagserve/layers/cpu_matmul.py)
and applies the engine's own KV budget rule (flagserve/engine/kv_budget.py) to the weights it
counted.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from flagserve.config.errors import ConfigError
from flagserve.config.schema import LLMModule
from flagserve.config.topology import engine_args_for
from flagserve.engine.kv_budget import capacity_blocks, kv_budget_bytes
from flagserve.models.config import DTYPE_BYTES, ModelConfig, auto_dtype, load_model_config
from flagserve.models.gguf import gguf_cpu_block_bytes, gguf_param_count
from flagserve.models.weight_shapes import expected_shape
from kernels.env import KERNELS_ENV, MATMUL_ENV, WEIGHTS_ENV

ASSUMED_GPU_GIB = 80.0


@dataclass
class MemoryEstimate:
    model: ModelConfig
    dtype: str
    num_params: int
    weights_bytes: int  # per device
    kv_bytes_per_token: int  # per device
    kv_budget_bytes: int
    kv_tokens: int
    max_model_len: int
    budget_source: str  # what the budget was derived from
    budget_key: str | None = None  # the engine arg that sets it where the engine's count is this one

    @property
    def too_small(self) -> bool:
        """The KV cache holds less than one sequence of max_model_len: the engine refuses."""
        return self.kv_tokens < self.max_model_len


def count_params(model: Path, cfg: ModelConfig) -> int:
    if cfg.checkpoint_format == "gguf":
        return gguf_param_count(model)  # as dequantized: the engine holds them in its dtype
    total = 0
    for file in sorted(model.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            shapes = {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}
        except (struct.error, ValueError, TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"{file}: not a whole safetensors file ({type(err).__name__}: "
                             f"{str(err)[:120]})") from None
        for name, shape in shapes.items():
            want = expected_shape(name, cfg)
            if want is not None and shape != want:  # what loading would refuse (decoder.py)
                raise ValueError(f"{file}: tensor {name!r} has shape {list(shape)}, but "
                                 f"config.json implies {list(want)}")
        total += sum(math.prod(shape) for shape in shapes.values())
    if total:
        return total
    # No weights on disk (a plan made before downloading): estimate from the shapes.
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    attn = h * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return L * (attn + 3 * h * i) + embed


def gpu_memory_bytes() -> int | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return int(out[0]) * 2**20 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def keeps_gguf_blocks(envs: dict[str, str]) -> bool:
    """Whether a float32 CPU engine with these (exported) experiment.envs keeps a GGUF file's
    Q4_1/Q8_0 blocks beside the float32 weights: the native matmul with `auto` weights does
    (layers/cpu_matmul.py pack_weight)."""
    return (envs.get(WEIGHTS_ENV, "auto") == "auto"
            and envs.get(MATMUL_ENV, "auto") in ("auto", "native")
            and envs.get(KERNELS_ENV, "auto") != "torch")


def estimate(module_id: str, module: LLMModule, gpu: bool,
             envs: dict[str, str] | None = None) -> MemoryEstimate:
    args = engine_args_for(module)
    try:
        cfg = load_model_config(args.model)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"serve.{module_id}.engine_args.model", str(err),
                          "serve a supported architecture (see flagserve/models/architectures.py)") from None
    dtype = auto_dtype(cfg, gpu) if args.dtype == "auto" else args.dtype
    elem = DTYPE_BYTES.get(dtype, 4)
    tp, pp = module.tensor_parallel_size, module.pipeline_parallel_size
    try:
        params = count_params(Path(args.model), cfg)
    except ValueError as err:
        raise ConfigError(f"serve.{module_id}.engine_args.model", str(err),
                          "point it at a complete checkpoint whose config.json matches its "
                          "weights (a download cut short, or files of two models?)") from None
    weights = params * elem // (tp * pp)
    if not gpu and cfg.checkpoint_format == "gguf" and dtype == "float32" \
            and keeps_gguf_blocks(envs or {}):
        weights += gguf_cpu_block_bytes(args.model) // (tp * pp)
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    kv_per_token = 2 * math.ceil(cfg.num_hidden_layers / pp) * kv_heads * cfg.head_dim * elem
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    if gpu:
        device = gpu_memory_bytes()
        size = f"{device / 2**30:.0f} GiB GPU" if device else \
            f"{ASSUMED_GPU_GIB:.0f} GiB GPU (assumed: no GPU visible here)"
        source = f"{args.gpu_memory_utilization:.0%} of a {size}"
        budget = kv_budget_bytes(args, cfg, max_model_len, device or int(ASSUMED_GPU_GIB * 2**30),
                                 weights)
        key = None  # the device's free memory decides at start
    else:
        source = f"cpu_kv_cache_space_gib={args.cpu_kv_cache_space_gib}"
        budget = kv_budget_bytes(args, cfg, max_model_len, None, 0)
        key = "cpu_kv_cache_space_gib"
    if args.num_kv_blocks:
        source, key = f"num_kv_blocks={args.num_kv_blocks}", "num_kv_blocks"
        kv_tokens = args.num_kv_blocks * args.block_size
        budget = kv_tokens * kv_per_token
    else:
        blocks = capacity_blocks(args, max_model_len, budget, kv_per_token * args.block_size)
        kv_tokens = blocks * args.block_size
    return MemoryEstimate(cfg, dtype, params, weights, kv_per_token, budget, kv_tokens,
                          max_model_len, source, key)
