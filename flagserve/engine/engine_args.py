"""Engine configuration: what a user passes to LLM(...) or a serve config's engine_args."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal, get_args

from flagserve.engine.kv_transfer.config import KVTransferConfig
from flagserve.engine.sampling_params import SEED_MAX, SEED_MIN, is_int, is_number

if TYPE_CHECKING:
    from flagserve.models.config import ModelConfig

Dtype = Literal["auto", "float32", "float16", "bfloat16"]  # auto: models/config.py auto_dtype
# The kernels (kernels/backend.py): torch reference, our Triton kernels, or auto (Triton on CUDA)
AttentionBackend = Literal["auto", "torch", "triton"]
# fcfs: requests in arrival order; priority (vLLM's): a request's priority first (lower is
# earlier), then arrival; the running sequence of the latest priority is preempted first
SchedulingPolicy = Literal["fcfs", "priority"]
# auto (vLLM's): the model's generation_config.json sets the sampling defaults of requests that
# leave them unset (LLM.get_default_sampling_params); vllm: SamplingParams' own defaults
GenerationConfig = Literal["auto", "vllm"]
# vLLM's load_format: "auto" reads the checkpoint; "dummy" draws random weights on the device
# from the model's config alone (benchmarks of a shape without its checkpoint).
LoadFormat = Literal["auto", "dummy"]


DEVICE_INDEX = re.compile(r"cuda:\d+")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings (a torch.dtype too)


def _check(ok: object, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"EngineArgs.{name} {message}")


@dataclass
class EngineArgs:
    model: str  # an HF model directory or a .gguf file
    tokenizer: str | None = None  # a directory or .gguf file; defaults to the model
    dtype: Dtype = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16
    max_num_seqs: int = 256
    # default: with chunked prefill 16384 on a GPU, 4096 on CPU (kv_budget.py); else max_model_len
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # default: derived from the memory budget below
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory the engine may use
    cpu_kv_cache_space_gib: float = 4.0  # CPU: memory for the KV cache
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    generation_config: GenerationConfig = "auto"
    attention_backend: AttentionBackend = "auto"
    load_format: LoadFormat = "auto"
    seed: int = 0
    # True: plain eager forward. False: CUDA graphs for decode on CUDA, the compiled decoder
    # on CPU (vLLM's flag of the same name; FlagScale configs carry it).
    enforce_eager: bool = False
    # Overlap (vLLM's flag of the same name): schedule and prepare step N+1 while the device
    # runs step N, the decode inputs taken from step N's samples where they are, on the device.
    # In-process engines only (TP = PP = 1, no KV transfer); steps with grammars or penalties,
    # which need every token on the host first, run one at a time. None: on where that holds
    # and the device is CUDA (1.15x on nano-vllm's workload on an H200), off on CPU, where the
    # "device" is the same cores and overlap buys nothing.
    async_scheduling: bool | None = None
    # Shards: TP x PP worker processes (Ray actors) instead of the model in this process.
    tensor_parallel_size: int = 1  # splits heads, MLP columns and vocabulary within a stage
    pipeline_parallel_size: int = 1  # splits the layers into consecutive stages
    placement_hosts: list[str] | None = None  # per stage: the host (Ray resource "host:<ip>")
    # Prefill/decode disaggregation: this engine's KV transfer endpoint (a dict from a config
    # becomes a KVTransferConfig). None: no transfers, unless a transport is given to LLMEngine.
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a pathlib.Path works as its string would
            self.model = os.fspath(self.model)
        if isinstance(self.kv_transfer, dict):
            self.kv_transfer = KVTransferConfig(**self.kv_transfer)
        _check(isinstance(self.model, str) and bool(self.model), "model",
               "must be a model directory or .gguf file path")
        _check(self.tokenizer is None or isinstance(self.tokenizer, (str, os.PathLike)), "tokenizer",
               f"must be a tokenizer directory or .gguf file path, got {self.tokenizer!r}")
        _check(self.device in ("auto", "cpu", "cuda") or DEVICE_INDEX.fullmatch(str(self.device)),
               "device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        self.dtype = DTYPE_ALIASES.get(str(self.dtype), str(self.dtype).removeprefix("torch."))
        for name, mode in (("dtype", Dtype), ("attention_backend", AttentionBackend),
                           ("load_format", LoadFormat), ("scheduling_policy", SchedulingPolicy),
                           ("generation_config", GenerationConfig)):
            value = getattr(self, name)
            _check(value in get_args(mode), name, f"must be one of {get_args(mode)}, got {value!r}")
        self._check_sizes()
        self._check_flags()
        self._check_layout()

    def _check_sizes(self) -> None:
        _check(is_int(self.block_size, 1) and self.block_size & (self.block_size - 1) == 0,
               "block_size", f"must be a positive power of two, got {self.block_size!r}")
        for name in ("max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _check(is_int(value, 1), name, f"must be an integer >= 1, got {value!r}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            _check(value is None or is_int(value, 1), name,
                   f"must be a positive integer or None, got {value!r}")
        _check(is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(is_number(self.cpu_kv_cache_space_gib) and self.cpu_kv_cache_space_gib > 0,
               "cpu_kv_cache_space_gib", f"must be a number > 0, got {self.cpu_kv_cache_space_gib!r}")
        _check(is_int(self.seed, SEED_MIN, SEED_MAX), "seed",
               f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")

    def _check_flags(self) -> None:
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        _check(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
               "async_scheduling", f"must be true, false or null (auto), got {self.async_scheduling!r}")

    def _check_layout(self) -> None:
        hosts = self.placement_hosts
        _check(hosts is None or (isinstance(hosts, (list, tuple))
                                 and all(isinstance(h, str) and h for h in hosts)
                                 and len(hosts) == self.pipeline_parallel_size), "placement_hosts",
               f"must be None or one host address per pipeline stage "
               f"({self.pipeline_parallel_size}), got {hosts!r}")
        _check(not self.async_scheduling or self.in_one_process, "async_scheduling",
               "needs the engine in one process: tensor_parallel_size = pipeline_parallel_size = "
               "1 and no kv_transfer; set it false (or leave it null) for this layout")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def in_one_process(self) -> bool:
        return self.world_size == 1 and self.kv_transfer is None

    def overlaps_steps(self, device_type: str, kv_transport: object = None) -> bool:
        """async_scheduling as it applies to an engine on `device_type` ("cuda", "cpu")."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.in_one_process and kv_transport is None and device_type == "cuda"

    def check_parallelism(self, cfg: ModelConfig) -> None:
        """TP must split the heads and MLP evenly, PP needs a layer per stage. (The vocabulary
        need not divide: the last vocabulary shard is zero-padded.)"""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for what, size in (("num_attention_heads", cfg.num_attention_heads),
                           ("num_key_value_heads", cfg.num_key_value_heads),
                           ("intermediate_size", cfg.intermediate_size)):
            if size % tp:
                raise ValueError(f"EngineArgs.tensor_parallel_size must divide the model's "
                                 f"{what}={size}, got {tp}")
        if cfg.num_hidden_layers < pp:
            raise ValueError(f"EngineArgs.pipeline_parallel_size must be at most the model's "
                             f"{cfg.num_hidden_layers} layers (a stage needs one), got {pp}")

    def to_dict(self) -> dict:
        return asdict(self)
