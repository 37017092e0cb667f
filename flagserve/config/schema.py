"""The experiment schema: one dataclass per YAML section, defaults as in conf/serve.yaml (but
exp_name and exp_dir, which name that file's experiment; a test holds them together).

Shape follows FlagScale's serve experiments (experiment.{exp_name, exp_dir, task, runner,
envs, cmds}, action, serve); field names users touch follow vLLM (engine_args, model_name).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from flagserve.engine.kv_transfer.config import KVTransferMode
from flagserve.models.architectures import Arch
from flagserve.models.packaged import PackagedModel

# The modes of the experiment, as types: config/typed.py rejects any other value by key.
Action = Literal["run", "stop", "status", "test", "plan", "bench"]
Ingress = Literal["auto", "engine", "separate"]
HttpServer = Literal["auto", "replicas", "serve_proxy"]
EngineCoreMode = Literal["auto", "process", "thread"]
# How a caller of an engine deployment picks the replica (flagserve/serve/routing/strategy.py)
RouterStrategy = Literal["prefix_aware", "least_loaded", "round_robin"]
# "auto" or a key of flagserve/entrypoints/openai/tool_parsers.TOOL_PARSERS (a test keeps the two equal)
ToolCallParser = Literal["auto", "hermes"]
Engine = Literal["flagserve"]  # FlagServe runs its own engine (FlagScale's `vllm` maps here)
KnownHosts = Literal["strict", "auto_add", "ignore"]
BenchDataset = Literal["random", "shared-prefix", "jsonl", "json-schema"]
BenchEndpoint = Literal["completions", "chat"]
BenchBaseline = Literal["serving_path", "prefix_caching", "continuous_batching"]
BENCH_BASELINES: tuple[BenchBaseline, ...] = get_args(BenchBaseline)
API_KEY_ENV = "FLAGSERVE_API_KEY"  # like vLLM's VLLM_API_KEY
# Fields of engine_args that describe placement rather than one engine process: the engine
# deployment turns them into shard workers (TP x PP) in a placement group.
PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")


@dataclass
class ApiLimits:
    """What one HTTP request may ask of a replica (README, HTTP API). A request past a limit
    gets an OpenAI-shaped 400 naming the field (413 for the body, 431 for the headers)."""
    # The body is refused from its Content-Length before it is read, or as soon as a chunked
    # body passes it. 16 MiB holds a batch of 16 prompts of 128k tokens as text.
    max_body_bytes: int = 16 * 2**20
    max_header_bytes: int = 32 * 2**10  # request line and headers together (nginx: 4 x 8 KiB)
    max_prompts: int = 256  # prompts in one /v1/completions batch
    max_n: int = 128  # choices per prompt (OpenAI's own limit); each is a sequence in the batch
    max_tokens: int | None = None  # max_tokens / max_completion_tokens; null: the context window
    max_stop: int = 64  # entries of `stop`, and of `stop_token_ids`: checked at every step
    # messages of one chat request; each is validated and rendered on the replica (the 520k
    # empty messages 16 MiB holds take 3 s)
    max_messages: int = 4096


@dataclass
class DeployConfig:
    host: str = "127.0.0.1"  # the HTTP bind address; 0.0.0.0 exposes the endpoint
    port: int = 8000
    api_key: str | None = None  # or $FLAGSERVE_API_KEY; every route but /health needs it
    startup_timeout_s: float = 600.0  # `run` waits this long for /health
    # `stop` refuses new requests, gives the running ones this long to finish, then ends
    # what is left (streams: an error event and [DONE]); also Serve's graceful shutdown.
    drain_timeout_s: float = 30.0
    # Where the OpenAI HTTP server runs. engine: in every replica of the (one) LLM module's
    # engine, no Ray hop between them; separate: an `ingress` deployment of its own, calling
    # the engine deployments; auto: engine when the graph has one LLM module and
    # ingress_replicas is 1, else separate.
    ingress: Ingress = "auto"
    ingress_replicas: int = 1  # replicas of a separate ingress deployment
    # How HTTP reaches the ingress. replicas: every ingress replica listens on host:port
    # itself (SO_REUSEPORT; the kernel spreads connections), no proxy hop; serve_proxy: Ray
    # Serve's HTTP proxy on the head routes to the replicas (any host, autoscaling); auto:
    # replicas on one host without autoscaling, else serve_proxy.
    http_server: HttpServer = "auto"
    limits: ApiLimits = field(default_factory=ApiLimits)
    docs: bool = False  # serve /docs and /openapi.json (behind the API key like every route)


@dataclass
class SSHConfig:
    """How the multi-host runner reaches the hosts of the hostfile (paramiko, key auth only)."""
    user: str | None = None  # default: the hostfile's user=, else the local user
    key_file: str | None = None  # private key; null: ssh-agent and ~/.ssh/id_*
    # strict: reject unknown host keys | auto_add: trust and save them | ignore
    known_hosts: KnownHosts = "strict"
    known_hosts_file: str | None = None  # default ~/.ssh/known_hosts
    connect_timeout: float = 10.0  # seconds per connection attempt


@dataclass
class RunnerConfig:
    hostfile: str | None = None  # FlagScale format: `IP slots=N type=gpu`; null = this host
    ssh_port: int = 22  # FlagScale's key; a host's `ssh_port=` in the hostfile wins
    ssh: SSHConfig = field(default_factory=SSHConfig)
    ray_port: int = 6379  # GCS port of the Ray head started on the first host
    python: str | None = None  # interpreter on every host (same path); default: this one
    node_timeout_s: float = 120.0  # how long the head waits for every host's Ray node to join
    deploy: DeployConfig = field(default_factory=DeployConfig)


@dataclass
class TaskConfig:
    type: Literal["serve"] = "serve"
    # FlagScale writes `vllm` here; FlagServe's engine serves it
    backend: Literal["flagserve", "vllm"] | None = None


@dataclass
class CmdsConfig:
    before_start: str | None = None  # shell line run before start; its exports reach the server
    after_stop: str | None = None


@dataclass
class BenchConfig:
    """action=bench: the workload sent to this experiment's endpoint (see docs/bench.md)."""
    dataset: BenchDataset = "random"
    dataset_path: str | None = None  # jsonl: one {"prompt": ..., "output_len": ...} per line
    num_prompts: int = 200
    input_len: int = 128  # prompt tokens (shared-prefix: after the prefix)
    output_len: int = 64  # max_tokens (with ignore_eos: exactly this many)
    range_ratio: float = 0.5  # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 512  # shared-prefix: tokens of the shared system prompt
    num_prefixes: int = 1  # shared-prefix: system prompts, one drawn per request
    request_rate: float = 20.0  # Poisson arrivals per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most
    endpoint: BenchEndpoint = "completions"
    ignore_eos: bool = True
    seed: int = 0
    warmup: int = 2  # requests sent first and not counted
    # Passes of the serving_path comparison: HTTP and in-process each run this many times,
    # pass i on its own prompts (seed + i, so no pass hits another's prefix cache); the
    # overheads are medians over the passes.
    repeats: int = 1
    baselines: list[BenchBaseline] = field(default_factory=lambda: list(BENCH_BASELINES))
    module: str | None = None  # the LLM module to bench; default: the first one
    result_dir: str | None = None  # default: <exp_dir>/bench
    compare_base_url: str | None = None  # also send the workload to this OpenAI-compatible server
    compare_model: str | None = None  # the `model` it serves (default: ours)
    progress: bool = True  # a progress bar while requests run


@dataclass
class ExperimentConfig:
    exp_name: str = "flagserve"
    exp_dir: str = "outputs/flagserve"
    task: TaskConfig = field(default_factory=TaskConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    envs: dict[str, str | int | float | bool] = field(default_factory=dict)
    cmds: CmdsConfig = field(default_factory=CmdsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)  # action=bench

    def exported_envs(self) -> dict[str, str]:
        """`envs` as the processes get them: strings, YAML booleans as 1/0."""
        return {k: ("1" if v else "0") if isinstance(v, bool) else str(v)
                for k, v in self.envs.items()}


@dataclass
class ResourcesConfig:
    """Ray Serve deployment options of one module (per replica)."""
    num_replicas: int = 1
    min_replicas: int | None = None  # min/max switch on Ray Serve autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica
    max_ongoing_requests: int | None = None  # Serve's per-replica admission limit
    num_cpus: float | None = None  # default: a CPU engine its share of the host's cores, else 0
    num_gpus: float | None = None  # engines: derived from device and TP x PP

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


@dataclass
class TokenizerResources(ResourcesConfig):
    """The tokenizer's deployment: none by default (the ingress tokenizes, one Ray hop less)."""
    num_replicas: int = 0


@dataclass
class RouterConfig:
    """Which engine replica a request goes to, when a caller routes to them (README, Routing)."""
    # prefix_aware: the replica that already holds the prompt's leading KV blocks, unless it
    # is more than max_imbalance busier than the least loaded; least_loaded; round_robin.
    strategy: RouterStrategy = "prefix_aware"
    prefix_blocks: int = 32  # leading blocks (block_size tokens each) hashed per prompt
    # prefix_aware: how much busier (in load units) the replica holding the prefix may be
    # than the least loaded one and still get the request
    max_imbalance: float = 8.0
    # load = ongoing requests + kv_usage_weight x KV cache usage (0..1) of the replica
    kv_usage_weight: float = 8.0
    stats_period_s: float = 1.0  # how often each replica reports running/waiting/KV usage


@dataclass
class RoleResources:
    """Ray Serve options of each replica of one role of a disaggregated module."""
    num_cpus: float | None = None  # default: a CPU engine its share of the host's cores
    num_gpus: float | None = None  # derived from device and TP x PP
    max_ongoing_requests: int | None = None  # default: 4 * max_num_seqs


@dataclass
class RoleConfig:
    """The prefill or the decode side of a disaggregated module: replicas of an engine of
    its own, built from the module's engine_args with this role's on top."""
    num_replicas: int = 1
    # Both set: Ray Serve autoscales the role between them (num_replicas is then ignored), on
    # its own load: decode on the requests its engines hold (running + waiting), prefill on
    # the prompt tokens queued in its engines; scale-down drains (README, Autoscaling).
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_running_requests: float | None = None  # decode, per replica; default max_num_seqs
    # prefill, per replica; default 2 x max_num_batched_tokens (about two steps of prompts)
    target_queued_tokens: float | None = None
    resources: RoleResources = field(default_factory=RoleResources)
    # A hostfile address its replicas run on (pinned with Ray's `host:<address>` resource);
    # null: wherever Ray finds room. FlagScale's prefill_address / decode_address.
    host: str | None = None
    # e.g. a larger max_num_batched_tokens for prefill, more max_num_seqs for decode; what
    # shapes the KV blocks (model, dtype, block_size) must stay the module's
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation of one LLM module (README, Prefill/decode
    disaggregation): prefill replicas run prompts and hand each request, after its first
    token, to a decode replica, which receives its KV engine to engine over kv_transfer."""
    prefill: RoleConfig = field(default_factory=RoleConfig)
    decode: RoleConfig = field(default_factory=RoleConfig)
    kv_transfer: KVTransferMode = "auto"  # auto: nccl when the engines use GPUs, else gloo


Role = Literal["prefill", "decode"]
# What a role's autoscaling counts per replica (reported by its engines): decode replicas are
# full when their batch is, prefill replicas when prompts wait for compute.
ScaleMetric = Literal["running_requests", "queued_prompt_tokens"]


@dataclass
class LLMModule:
    """A model served by FlagServe's engine: one engine deployment; its prompts are tokenized
    in the ingress, or by a tokenizer deployment of their own when tokenizer.num_replicas > 0."""
    engine: Engine = "flagserve"
    engine_args: dict[str, Any] = field(default_factory=dict)
    # name(s) clients send as `model` (vLLM's served_model_name: the first is the one answers
    # carry); default: the model dir name
    model_name: str | list[str] | None = None
    # When engine_args.model is null: a real model shipped as a package (the default), or the
    # built-in tiny random-weight model of an architecture (fast tests). At most one of them.
    builtin_model: PackagedModel | None = None
    tiny_model: Arch | None = None
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tokenizer: TokenizerResources = field(default_factory=TokenizerResources)
    router: RouterConfig = field(default_factory=RouterConfig)  # choice among engine replicas
    # null: one engine does prefill and decode (aggregated); else two roles, two deployments
    disaggregation: DisaggregationConfig | None = None
    depends: list[str] = field(default_factory=list)  # user modules that preprocess requests
    # Where each replica's step loop runs: process | thread (why: flagserve/engine/core);
    # auto: process, or thread with TP x PP > 1 (the replica drives the shard workers itself).
    engine_core: EngineCoreMode = "auto"
    # How tool calls are found in the output for tool_choice auto (vLLM's --tool-call-parser):
    # a parser of the registry, or auto: the one whose markup the chat template uses.
    tool_call_parser: ToolCallParser = "auto"

    @property
    def tokenizer_deployment(self) -> bool:
        """False: the ingress tokenizes (no Ray Serve hop before the engine)."""
        return self.tokenizer.autoscaling or self.tokenizer.num_replicas > 0

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_args.get("tensor_parallel_size", 1))

    @property
    def pipeline_parallel_size(self) -> int:
        return int(self.engine_args.get("pipeline_parallel_size", 1))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class UserModule:
    """A user class from a .py file, deployed as its own deployment (e.g. a retriever)."""
    module: str = ""  # path to the .py file
    name: str = ""  # class name in it
    init_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of __init__
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    depends: list[str] = field(default_factory=list)


Module = LLMModule | UserModule


@dataclass
class Config:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    serve: dict[str, Module] = field(default_factory=dict)
    action: Action = "run"
    foreground: bool = False  # run: stay attached (container platforms) instead of returning

    @property
    def llms(self) -> dict[str, LLMModule]:
        return {k: m for k, m in self.serve.items() if isinstance(m, LLMModule)}

    @property
    def user_modules(self) -> dict[str, UserModule]:
        return {k: m for k, m in self.serve.items() if isinstance(m, UserModule)}

    @property
    def deploy(self) -> DeployConfig:
        return self.experiment.runner.deploy

    @property
    def api_key(self) -> str | None:
        """deploy.api_key, else $FLAGSERVE_API_KEY from `envs` or the environment."""
        envs = self.experiment.envs
        return (self.deploy.api_key or (str(envs[API_KEY_ENV]) if envs.get(API_KEY_ENV) else None)
                or os.environ.get(API_KEY_ENV) or None)

    @property
    def namespace(self) -> str:
        """The Ray namespace of this experiment: what `stop` tears down."""
        return f"flagserve-{self.experiment.exp_name}"
