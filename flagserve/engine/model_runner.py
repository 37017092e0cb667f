"""Runs one scheduled batch: flatten it, run the model over the paged cache, sample."""
import time
from dataclasses import dataclass

import numpy as np
import torch

from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.scheduler import ScheduledBatch
from flagserve.engine.sequence import Sequence
from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from flagserve.models.config import ModelConfig
from flagserve.models.loader import load_model
from kernels import get_ops

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        return DTYPES.get(cfg.torch_dtype, torch.float32)
    return DTYPES[name]


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sampling_seqs: list[Sequence]  # the sequences those rows belong to


class ModelRunner:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], tp_rank: int = 0, tp_size: int = 1):
        self.args = args
        self.cfg = cfg
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, cfg)
        self.ops = get_ops(args.attention_backend, self.device)
        self.model = load_model(args.model, cfg, self.ops, self.dtype, self.device, tp_rank, tp_size)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.num_kv_blocks = args.num_kv_blocks or self._blocks_from_memory_budget()
        self._allocate_kv_cache()
        self.sampler = Sampler(args.seed, self.device)
        self.forward_seconds = 0.0  # model forward and LM head, for overhead accounting

    # KV cache

    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.cfg.num_hidden_layers * self.block_size * self.num_kv_heads * self.cfg.head_dim * elem

    def _blocks_from_memory_budget(self) -> int:
        # Never more than every sequence slot filled to max_model_len could use.
        useful = self.args.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            activations = self._activation_bytes_estimate()
            budget = int(total * self.args.gpu_memory_utilization) - used - activations
        else:
            budget = int(self.args.cpu_kv_cache_space_gib * 2**30)
        blocks = min(useful, budget // self.block_bytes())
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache budget holds {max(blocks, 0) * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: lower max_model_len, or raise "
                f"{'gpu_memory_utilization' if self.device.type == 'cuda' else 'cpu_kv_cache_space_gib'}")
        return blocks

    def _activation_bytes_estimate(self) -> int:
        cfg = self.cfg
        tokens = self.args.max_num_batched_tokens or 2048
        width = cfg.hidden_size * 4 + cfg.intermediate_size * 3 + cfg.num_attention_heads * cfg.head_dim * 3
        logits = self.args.max_num_seqs * cfg.vocab_size * 4 * 3
        return tokens * width * 4 + logits

    def _allocate_kv_cache(self) -> None:
        # Zero-filled: masked attention lanes multiply cache contents by 0, and 0 * NaN = NaN.
        shape = (self.num_kv_blocks, self.block_size, self.num_kv_heads, self.cfg.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # One step

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        bs = self.block_size
        input_ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_seqs: list[Sequence] = []
        cu_seqlens_q = [0]
        num_decodes = 0
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            if n == 1:
                num_decodes += 1
                pos_parts.append(np.array([start]))
                slot_parts.append(np.array([seq.block_table[start // bs] * bs + start % bs]))
            else:
                pos = np.arange(start, end)
                pos_parts.append(pos)
                slot_parts.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
                cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            seq_lens.append(end)
            offset += n
            if end == seq.num_tokens:  # the chunk reaches the end: sample the next token
                logits_indices.append(offset - 1)
                sampling_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=dev),
        )
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling_seqs=sampling_seqs,
        )

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.params for s in seqs]
        dev = self.device
        vocab = self.cfg.vocab_size

        def column(values: list, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = SamplingBatch(
            temperatures=column([p.temperature for p in params]),
            top_ks=column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
            if any(p.top_k > 0 for p in params) else None,
            top_ps=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_ps=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            all_greedy=all(p.greedy for p in params),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        if any(p.has_penalties for p in params):
            batch.repetition_penalties = column([p.repetition_penalty for p in params])
            batch.presence_penalties = column([p.presence_penalty for p in params])
            batch.frequency_penalties = column([p.frequency_penalty for p in params])
            batch.output_token_ids = [s.output_token_ids for s in seqs]
            batch.prompt_token_ids = [s.token_ids[:s.num_prompt_tokens] for s in seqs]
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            batch.banned_token_ids = [
                (s.params.stop_token_ids + ([] if s.params.ignore_eos else list(self.eos_token_ids)))
                if s.num_output_tokens < s.params.min_tokens else [] for s in seqs]
        generators = {i: s.generator for i, s in enumerate(seqs) if s.generator is not None}
        batch.generators = generators or None
        return batch

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        prepared = self.prepare(batch)
        start = time.perf_counter()
        hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
        if not prepared.sampling_seqs:
            self.forward_seconds += time.perf_counter() - start
            return [], None
        logits = self.model.compute_logits(hidden[prepared.logits_indices])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # attribute GPU time to the forward
        self.forward_seconds += time.perf_counter() - start
        output = self.sampler(logits, self.sampling_batch(prepared.sampling_seqs))
        return prepared.sampling_seqs, output
