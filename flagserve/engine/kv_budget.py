"""How many KV-cache blocks a device holds: one rule for the engine and for `action=plan`."""
from flagserve.engine.engine_args import EngineArgs
from flagserve.models.config import ModelConfig

DEFAULT_CHUNKED_BATCH_TOKENS = 4096  # max_num_batched_tokens when chunked prefill picks it


def batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """The per-step token budget: as configured, else 4096 with chunked prefill, else a prompt."""
    return args.max_num_batched_tokens or (
        DEFAULT_CHUNKED_BATCH_TOKENS if args.enable_chunked_prefill else max_model_len)


def activation_bytes(args: EngineArgs, cfg: ModelConfig, max_model_len: int) -> int:
    """A generous bound on one step's activations (fp32 worst case) plus the sampler's logits."""
    width = cfg.hidden_size * 4 + cfg.intermediate_size * 3 + cfg.num_attention_heads * cfg.head_dim * 3
    logits = args.max_num_seqs * cfg.vocab_size * 4 * 3
    return batched_tokens(args, max_model_len) * width * 4 + logits


def kv_budget_bytes(args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                    device_total: int | None, device_used: int) -> int:
    """Bytes left for the KV cache: gpu_memory_utilization of a GPU of device_total bytes minus
    what is in use and the activations, or cpu_kv_cache_space_gib when device_total is None."""
    if device_total is None:
        return int(args.cpu_kv_cache_space_gib * 2**30)
    return (int(device_total * args.gpu_memory_utilization) - device_used
            - activation_bytes(args, cfg, max_model_len))


def capacity_blocks(args: EngineArgs, max_model_len: int, budget: int, block_bytes: int) -> int:
    """Blocks the budget holds, never more than every sequence slot at max_model_len could use."""
    useful = args.max_num_seqs * -(-max_model_len // args.block_size) + 1
    return max(min(useful, budget // block_bytes), 0)
