"""How many KV-cache blocks a device holds: one rule for the engine and for `action=plan`."""
from flagserve.engine.engine_args import EngineArgs
from flagserve.models.config import ModelConfig

# max_num_batched_tokens when chunked prefill picks it, on a GPU and on CPU (vLLM's offline
# defaults). A GPU runs steps with prompt tokens eagerly, each paying the host's launch time
# once: fewer, larger ones leave it less idle. A CPU step costs its tokens' work whatever its
# size, and its linears' row chunks (cpu_linear.cpp) were tuned at 4096. A served CPU engine
# takes 2048 (as vLLM's OpenAI server on CPU): a prompt's first token leaves at the end of the
# step that finishes it, so in a burst of prompts half of them are out sooner with smaller
# steps, at the same throughput (measured: docs/performance.md, CPU).
GPU_CHUNKED_BATCH_TOKENS, CPU_CHUNKED_BATCH_TOKENS = 16384, 4096
SERVED_CPU_BATCH_TOKENS = 2048


def default_batched_tokens(on_gpu: bool, served: bool = False) -> int:
    if on_gpu:
        return GPU_CHUNKED_BATCH_TOKENS
    return SERVED_CPU_BATCH_TOKENS if served else CPU_CHUNKED_BATCH_TOKENS


def batched_tokens(args: EngineArgs, max_model_len: int, on_gpu: bool) -> int:
    """The per-step token budget: as configured, else the device's default with chunked
    prefill, else a whole prompt."""
    return args.max_num_batched_tokens or (
        default_batched_tokens(on_gpu) if args.enable_chunked_prefill else max_model_len)


GRAPH_POOL_OVERHEAD = 256 * 2**20  # cuBLAS workspace of the capture stream, split-K scratch


def token_activation_bytes(cfg: ModelConfig) -> int:
    """A generous bound on one token's activations through a layer (fp32 worst case)."""
    width = cfg.hidden_size * 4 + cfg.intermediate_size * 3 + cfg.num_attention_heads * cfg.head_dim * 3
    return width * 4


def activation_bytes(args: EngineArgs, cfg: ModelConfig, max_model_len: int) -> int:
    """A generous bound on one GPU step's activations (fp32 worst case) plus the sampler's logits."""
    logits = args.max_num_seqs * cfg.vocab_size * 4 * 3
    return batched_tokens(args, max_model_len, True) * token_activation_bytes(cfg) + logits


def graph_pool_bytes(args: EngineArgs, cfg: ModelConfig) -> int:
    """What the decode CUDA graphs keep (model_runner.py): their memory pool, which eager steps
    cannot use, holds the activations of the largest padded batch (max_num_seqs rows)."""
    if args.enforce_eager:
        return 0
    return args.max_num_seqs * token_activation_bytes(cfg) + GRAPH_POOL_OVERHEAD


def kv_budget_bytes(args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                    device_total: int | None, device_used: int) -> int:
    """Bytes left for the KV cache: gpu_memory_utilization of a GPU of device_total bytes minus
    what is in use, the activations and the CUDA graphs' pool (captured after the cache is
    allocated, so reserved here), or cpu_kv_cache_space_gib when device_total is None."""
    if device_total is None:
        return int(args.cpu_kv_cache_space_gib * 2**30)
    return (int(device_total * args.gpu_memory_utilization) - device_used
            - activation_bytes(args, cfg, max_model_len) - graph_pool_bytes(args, cfg))


def capacity_blocks(args: EngineArgs, max_model_len: int, budget: int, block_bytes: int) -> int:
    """Blocks the budget holds, never more than every sequence slot at max_model_len could use."""
    useful = args.max_num_seqs * -(-max_model_len // args.block_size) + 1
    return max(min(useful, budget // block_bytes), 0)
