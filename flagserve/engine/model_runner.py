"""Runs one step on one model shard: flatten the StepInput, forward over the paged cache, sample.

The in-process engine (TP = PP = 1) and every shard worker run this same class; a shard only
differs by its ParallelContext: later pipeline stages receive activations instead of token
ids, earlier ones send them on, and only the last stage's TP rank 0 samples.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.distributed.pipeline import recv_activations, send_activations
from flagserve.engine.engine_args import Dtype, EngineArgs
from flagserve.engine.kv_budget import capacity_blocks, kv_budget_bytes
from flagserve.engine.sampling_params import SamplingParams
from flagserve.engine.step_input import StepInput
from flagserve.layers.attention_metadata import AttentionMetadata
from flagserve.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from flagserve.models.config import ModelConfig, auto_dtype
from flagserve.models.loader import load_model
from kernels import get_ops

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: Dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    return DTYPES[auto_dtype(cfg, device.type == "cuda") if name == "auto" else name]


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled


@dataclass
class SeqSampling:
    """What the sampling shard keeps of a sequence between steps."""
    params: SamplingParams
    prompt_token_ids: list[int]  # empty unless penalties need them
    generator: torch.Generator | None  # seeded requests: survives preemption, dies with the seq


class ModelRunner:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, max_model_len: int,
                 eos_token_ids: tuple[int, ...], par: ParallelContext = ParallelContext()):
        self.args = args
        self.cfg = cfg
        self.par = par
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.ops = get_ops(args.attention_backend, self.device)
        self.model = load_model(args.model, cfg, self.ops, self.dtype, self.device, par)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.num_kv_blocks = 0  # set by allocate_kv_cache once every shard's capacity is known
        self.sampler = Sampler(args.seed, self.device) if par.samples else None
        self.seqs: dict[int, SeqSampling] = {}  # seq_id -> state, on the sampling shard only
        self.forward_seconds = 0.0  # model forward and LM head, for overhead accounting

    # KV cache: this shard's layers and KV heads only

    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.model.layers) * self.block_size * self.num_kv_heads * self.cfg.head_dim * elem

    def kv_capacity_blocks(self) -> int:
        """Blocks this shard can hold; the engine takes the minimum over shards."""
        total, used = None, 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
        budget = kv_budget_bytes(self.args, self.cfg, self.max_model_len, total, used)
        return capacity_blocks(self.args, self.max_model_len, budget, self.block_bytes())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Zero-filled: masked attention lanes multiply cache contents by 0, and 0 * NaN = NaN.
        self.num_kv_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.cfg.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # One step

    def prepare(self, step: StepInput) -> PreparedBatch:
        bs = self.block_size
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        seq_lens: list[int] = []
        cu_seqlens_q = [0]
        ends = np.cumsum(step.num_new_tokens)
        num_decodes = 0
        for start, n, table in zip(step.start_positions, step.num_new_tokens, step.block_tables):
            if n == 1:
                num_decodes += 1
                pos_parts.append(np.array([start]))
                slot_parts.append(np.array([table[start // bs] * bs + start % bs]))
            else:
                pos = np.arange(start, start + n)
                pos_parts.append(pos)
                slot_parts.append(np.asarray(table)[pos // bs] * bs + pos % bs)
                cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            seq_lens.append(start + n)
        max_blocks = max(map(len, step.block_tables))
        tables = [t + [0] * (max_blocks - len(t)) for t in step.block_tables]
        dev = self.device
        meta = AttentionMetadata(
            num_decode_tokens=num_decodes,
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=dev),
        )
        return PreparedBatch(
            input_ids=torch.tensor(step.token_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_indices=torch.from_numpy(ends[step.sample_indices] - 1).to(dev),
        )

    def track_sequences(self, step: StepInput) -> None:
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            gen = None
            if new.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(new.seed)
            self.seqs[new.seq_id] = SeqSampling(new.params, new.prompt_token_ids or [], gen)

    def sampling_batch(self, step: StepInput) -> SamplingBatch:
        seqs = [self.seqs[step.seq_ids[i]] for i in step.sample_indices]
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
        if step.output_token_ids is not None:
            batch.repetition_penalties = column([p.repetition_penalty for p in params])
            batch.presence_penalties = column([p.presence_penalty for p in params])
            batch.frequency_penalties = column([p.frequency_penalty for p in params])
            batch.output_token_ids = step.output_token_ids
            batch.prompt_token_ids = [s.prompt_token_ids for s in seqs]
        if any(n < p.min_tokens for n, p in zip(step.num_output_tokens, params)):
            batch.banned_token_ids = [
                (p.stop_token_ids + ([] if p.ignore_eos else list(self.eos_token_ids)))
                if n < p.min_tokens else [] for n, p in zip(step.num_output_tokens, params)]
        generators = {i: s.generator for i, s in enumerate(seqs) if s.generator is not None}
        batch.generators = generators or None
        batch.token_bitmask = step.token_bitmask
        return batch

    @torch.inference_mode()
    def execute(self, step: StepInput) -> SamplerOutput | None:
        """The sampled tokens on the sampling shard (None when nothing samples), else None."""
        par = self.par
        if par.samples:
            self.track_sequences(step)
        prepared = self.prepare(step)
        start = time.perf_counter()
        hidden = residual = None
        if not par.is_first_stage:
            hidden, residual = recv_activations(step.num_tokens, self.cfg.hidden_size, self.dtype,
                                                self.device, par.prev_rank)
        hidden, residual = self.model(prepared.input_ids, prepared.positions, prepared.meta,
                                      hidden, residual)
        if not par.is_last_stage:
            send_activations(hidden, residual, par.next_rank)
            self.forward_seconds += time.perf_counter() - start
            return None
        if not step.sample_indices:
            self.forward_seconds += time.perf_counter() - start
            return None
        logits = self.model.compute_logits(hidden[prepared.logits_indices])  # None off TP rank 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # attribute GPU time to the forward
        self.forward_seconds += time.perf_counter() - start
        if not par.samples:
            return None
        return self.sampler(logits, self.sampling_batch(step))
