"""Runs one step on one model shard: flatten the StepInput, forward over the paged cache, sample.

The in-process engine (TP = PP = 1) and every shard worker run this same class; a shard only
differs by its ParallelContext: later pipeline stages receive activations instead of token
ids, earlier ones send them on, and only the last stage's TP rank 0 samples.
"""
import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.distributed.pipeline import recv_activations, send_activations
from flagserve.engine.cpu_model import prepare_cpu_model
from flagserve.engine.cpu_threads import ThreadTuner, tuning_enabled
from flagserve.engine.engine_args import Dtype, EngineArgs
from flagserve.engine.input_buffers import PreparedBatch, StepBuffers, bucket_for, decode_buckets
from flagserve.engine.kv_budget import batched_tokens, capacity_blocks, graph_pool_bytes, kv_budget_bytes
from flagserve.engine.prompt_logprobs import score_prompt_rows
from flagserve.engine.sampling_inputs import SeqSampling, sampling_batch
from flagserve.engine.step_input import StepInput
from flagserve.layers.sampler import (
    DeviceSamples,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    plain_greedy,
    seeded_generator,
)
from flagserve.models.config import ModelConfig, auto_dtype
from flagserve.models.loader import DTYPES, load_model
from kernels import KernelOps, get_ops

log = logging.getLogger(__name__)


@dataclass
class GraphCapture:
    """What capturing the decode CUDA graphs cost, as vLLM reports it at start-up."""
    sizes: int
    seconds: float
    reserved_bytes: int  # device memory the warm-up and capture left reserved (the graphs' pool)
    budget_bytes: int  # what kv_budget.graph_pool_bytes set aside for it


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: Dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    return DTYPES[auto_dtype(cfg, device.type == "cuda") if name == "auto" else name]


# How decode-only steps run. eager: at their exact size. padded: padded to a bucket
# (input_buffers.py), forward run eagerly: kernels that sync with the host (the torch
# reference on CUDA). graph: padded, and a CUDA graph of that bucket replayed. CPU steps run
# eager: with no graph to replay, a padded row is only more matmul work (up to 7 rows in 8).
DecodeMode = Literal["eager", "padded", "graph"]


def decode_mode(enforce_eager: bool, device: torch.device, ops: KernelOps) -> DecodeMode:
    if enforce_eager or device.type != "cuda":
        return "eager"
    return "graph" if ops.name == "triton" else "padded"


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
        self.model = load_model(args.model, cfg, self.ops, self.dtype, self.device, par,
                                random_weights=args.load_format == "dummy")
        # CPU: packed weights, native kernels, compiled ops (issue 16)
        self.ops = prepare_cpu_model(self.model, self.device, self.dtype, self.ops, args.enforce_eager)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.num_kv_blocks = 0  # set by allocate_kv_cache once every shard's capacity is known
        self.sampler = Sampler(args.seed, self.device, self.ops) if par.samples else None
        self.seqs: dict[int, SeqSampling] = {}  # seq_id -> state, on the sampling shard only
        self.forward_seconds = 0.0  # model forward and LM head, for overhead accounting
        self.last_samples: torch.Tensor | None = None  # async scheduling: the last step's tokens
        # Set by allocate_kv_cache (CUDA graphs bind the cache's addresses).
        self.buffers: StepBuffers | None = None
        self.decode_mode: DecodeMode = "eager"
        self.buckets: list[int] = []
        self.stage_inputs: torch.Tensor | None = None  # [2, rows, hidden]: padded later-stage input
        self.graphs = None  # cuda_graphs.DecodeGraphs in "graph" mode
        self.graph_capture: GraphCapture | None = None
        self.thread_tuner = None  # CPU: one or all threads, by measurement (cpu_threads.py)
        if self.device.type == "cpu" and tuning_enabled(torch.get_num_threads()):
            self.thread_tuner = ThreadTuner((torch.get_num_threads(), 1), torch.set_num_threads)

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
        self.prepare_decode_paths(decode_mode(self.args.enforce_eager, self.device, self.ops))

    @torch.inference_mode()
    def prepare_decode_paths(self, mode: DecodeMode) -> None:
        """Static step buffers, the buckets of the padded decode path, and in "graph" mode one
        CUDA graph per bucket, every worker capturing its own."""
        args, bs = self.args, self.block_size
        max_tokens = batched_tokens(args, self.max_model_len, self.device.type == "cuda")
        self.buffers = StepBuffers(max_tokens, args.max_num_seqs, -(-self.max_model_len // bs), bs,
                                   self.device, order_decodes=self.ops.orders_decodes)
        self.decode_mode, self.graphs, self.stage_inputs = mode, None, None
        self.buckets = [] if mode == "eager" else decode_buckets(min(args.max_num_seqs, max_tokens))
        if self.buckets and not self.par.is_first_stage:
            self.stage_inputs = torch.zeros(2, self.buckets[-1], self.cfg.hidden_size,
                                            dtype=self.dtype, device=self.device)
        if mode == "graph":
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        from flagserve.engine.cuda_graphs import DecodeGraphs  # CUDA only
        cuda = self.device.type == "cuda"  # else a stand-in (tests)
        if cuda:  # torch.cuda.graph empties the cache on entry: measure from an empty one too
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        start = time.perf_counter()
        self.graphs = DecodeGraphs(self._padded_forward, self.buckets)
        taken = torch.cuda.memory_reserved(self.device) - reserved if cuda else 0
        capture = self.graph_capture = GraphCapture(len(self.buckets), time.perf_counter() - start,
                                                    taken, graph_pool_bytes(self.args, self.cfg))
        log.info("captured %d decode CUDA graphs (1-%d rows) in %.1f s: %.2f GiB reserved, %.2f GiB "
                 "budgeted", capture.sizes, self.buckets[-1], capture.seconds,
                 capture.reserved_bytes / 2**30, capture.budget_bytes / 2**30)

    def _padded_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of a padded decode step of `rows` rows, on the static buffers as they are."""
        batch = self.buffers.padded_batch(rows)
        hidden = residual = None
        if self.stage_inputs is not None:
            hidden, residual = self.stage_inputs[0, :rows], self.stage_inputs[1, :rows]
        return self.model(batch.input_ids, batch.positions, batch.meta, hidden, residual)

    # One step

    def prepare(self, step: StepInput) -> PreparedBatch:
        pad_to = None
        if self.buckets and step.num_tokens == len(step.seq_ids):  # decode-only
            pad_to = bucket_for(step.num_tokens, self.buckets)
        batch = self.buffers.fill(step, pad_to)
        batch.take_pending(self.last_samples)
        return batch

    def run_model(self, batch: PreparedBatch, hidden: torch.Tensor | None,
                  residual: torch.Tensor | None, keep: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward over `batch` (padded rows included): a graph replay where one exists;
        `keep` (unpadded batches): the rows of the last stage's output (DecoderForCausalLM)."""
        if batch.padded and hidden is not None:  # a later stage: into the static inputs
            n, rows = batch.num_tokens, batch.num_rows
            self.stage_inputs[0, :n].copy_(hidden)
            self.stage_inputs[1, :n].copy_(residual)
            hidden, residual = self.stage_inputs[0, :rows], self.stage_inputs[1, :rows]
        if batch.padded and self.graphs is not None:
            return self.graphs.replay(batch.num_rows)
        return self.model(batch.input_ids, batch.positions, batch.meta, hidden, residual, keep)

    def track_sequences(self, step: StepInput) -> None:
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            gen = None
            if new.seed is not None:
                gen = seeded_generator(new.seed, self.device)
                if new.generator_state is not None:
                    gen.set_state(torch.frombuffer(bytearray(new.generator_state), dtype=torch.uint8))
            self.seqs[new.seq_id] = SeqSampling(new.params, new.prompt_token_ids or [], gen)

    def sampling_batch(self, step: StepInput) -> SamplingBatch:
        seqs = [self.seqs[step.seq_ids[i]] for i in step.sample_indices]
        return sampling_batch(seqs, step, self.cfg.vocab_size, self.eos_token_ids, self.device)

    def execute(self, step: StepInput, defer: bool = False) -> SamplerOutput | DeviceSamples | None:
        """The sampled tokens on the sampling shard (None when nothing samples), else None.
        defer (async scheduling, TP = PP = 1): the samples as the device will have them, a
        copy to the host under way, and nothing waited for."""
        if self.thread_tuner is None:
            return self._execute(step, defer)
        self.thread_tuner.start(step.num_tokens)
        start = time.perf_counter()
        out = self._execute(step, defer)
        self.thread_tuner.finish(time.perf_counter() - start)
        return out

    @torch.inference_mode()
    def _execute(self, step: StepInput, defer: bool) -> SamplerOutput | DeviceSamples | None:
        par = self.par
        if par.samples:
            self.track_sequences(step)
        prepared = self.prepare(step)
        start = time.perf_counter()
        hidden = residual = None
        if not par.is_first_stage:
            hidden, residual = recv_activations(step.num_tokens, self.cfg.hidden_size, self.dtype,
                                                self.device, par.prev_rank)
        # Rows not sampled (a prefill chunk's but its last) skip the last layer's o_proj and MLP
        # (all of them in a chunk that ends no prompt), unless they score a prompt.
        partial = len(step.sample_indices) < step.num_tokens and not step.prompt_rows
        keep = prepared.logits_indices if partial and par.is_last_stage and not prepared.padded else None
        hidden, residual = self.run_model(prepared, hidden, residual, keep)
        if not par.is_last_stage:
            n = step.num_tokens
            send_activations(hidden[:n], residual[:n], par.next_rank)
            self.forward_seconds += time.perf_counter() - start
            return None
        scores = None  # the engine never defers a step that scores (async scheduling)
        if step.prompt_rows:
            scores = score_prompt_rows(hidden, step.prompt_rows, self.model.compute_logits,
                                       self.cfg.vocab_size, self.ops.lse_and_ranks)
        if not step.sample_indices:
            self.forward_seconds += time.perf_counter() - start
            return None if scores is None else SamplerOutput([], None, None, None, None, scores)
        if keep is None:
            hidden = hidden[prepared.logits_indices]
        batch = self.sampling_batch(step) if par.samples else None
        # an all-greedy batch's tokens without its logits, where the LM head can (greedy_head.py)
        tokens = self.model.greedy_tokens(hidden, batch.token_bitmask) \
            if batch is not None and plain_greedy(batch, grammar=True) else None
        logits = None if tokens is not None else self.model.compute_logits(hidden)  # None off TP rank 0
        if self.device.type == "cuda" and not defer:
            torch.cuda.synchronize(self.device)  # attribute GPU time to the forward
        self.forward_seconds += time.perf_counter() - start  # deferred: the launches only
        if not par.samples:
            return None
        samples = DeviceSamples(tokens) if tokens is not None else self.sampler.sample(logits, batch)
        if not defer:
            out = samples.host()
            out.prompt_scores = scores
            return out
        self.last_samples = samples.tokens
        return samples.start_copy()
