"""Checks across fields and against the machine, run before anything starts.

Each failure is one ConfigError naming the key and the fix. `stop` and `status` only need the
experiment section, so a deleted model directory never prevents stopping a deployment.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
from pathlib import Path
from typing import get_args

from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import (
    PARALLEL_ARGS,
    ApiLimits,
    Config,
    ExperimentConfig,
    LLMModule,
    ResourcesConfig,
    RouterConfig,
    UserModule,
)
from flagserve.config.topology import (
    engine_args_for,
    engine_groups,
    ingress_autoscales,
    served_names,
    uses_gpu,
)
from flagserve.config.validate_disaggregation import check_disaggregation
from flagserve.engine.cpu_runtime import BIND_ENV, parse_cpu_list
from flagserve.models.architectures import GGUF_ARCHITECTURES, HF_ARCHITECTURES
from flagserve.models.config import ModelConfig, load_model_config, model_format
from kernels.env import SETTINGS

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
HOST_FIX = "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"  # deploy.host's values


def validate_experiment(config: Config) -> None:
    exp = config.experiment
    if not NAME_RE.match(exp.exp_name):
        raise ConfigError("experiment.exp_name", f"{exp.exp_name!r} is not a valid name",
                          "use letters, digits, '.', '_' and '-' only")
    if not exp.exp_dir:
        raise ConfigError("experiment.exp_dir", "must not be empty", "experiment.exp_dir=outputs/x")
    deploy = exp.runner.deploy
    if not 1 <= deploy.port <= 65535:
        raise ConfigError("experiment.runner.deploy.port", f"{deploy.port} is not a TCP port",
                          "use a port in 1..65535, e.g. 8000")
    if not deploy.host:
        raise ConfigError("experiment.runner.deploy.host", "must not be empty", HOST_FIX)
    if deploy.startup_timeout_s <= 0:
        raise ConfigError("experiment.runner.deploy.startup_timeout_s", "must be > 0", "e.g. 600")
    if deploy.drain_timeout_s < 0:
        raise ConfigError("experiment.runner.deploy.drain_timeout_s", "must be >= 0",
                          "e.g. 30 (0: end running requests at once)")
    if deploy.http_server == "replicas" and exp.runner.hostfile:
        raise ConfigError("experiment.runner.deploy.http_server",
                          "`replicas` serves HTTP on the host of each replica; with a hostfile "
                          "the endpoint is Ray Serve's proxy on the head",
                          "set experiment.runner.deploy.http_server=auto (or serve_proxy)")
    if deploy.ingress_replicas < 1:
        raise ConfigError("experiment.runner.deploy.ingress_replicas",
                          f"must be >= 1, got {deploy.ingress_replicas}", "e.g. 1")
    _check_limits(deploy.limits)
    _check_engine_envs(exp)
    runner = exp.runner
    for key, port in (("ssh_port", runner.ssh_port), ("ray_port", runner.ray_port)):
        if not 1 <= port <= 65535:
            raise ConfigError(f"experiment.runner.{key}", f"{port} is not a TCP port",
                              "use a port in 1..65535")
    if runner.hostfile:
        _check_ray_port(runner.ray_port, deploy.port)
    ssh = runner.ssh
    if ssh.connect_timeout <= 0 or runner.node_timeout_s <= 0:
        key = "ssh.connect_timeout" if ssh.connect_timeout <= 0 else "node_timeout_s"
        raise ConfigError(f"experiment.runner.{key}", "must be > 0", "e.g. 10")
    if runner.hostfile and config.action in ("run", "test"):
        for key, file in (("key_file", ssh.key_file), ("known_hosts_file", ssh.known_hosts_file)):
            if file and not Path(file).is_file() and not (key == "known_hosts_file"
                                                          and ssh.known_hosts == "auto_add"):
                raise ConfigError(f"experiment.runner.ssh.{key}", f"file {file!r} does not exist",
                                  "point it at an existing file, or set it to null for the default")


# The ports `ray start --head` (host_commands.ray_start) reserves for itself with its defaults;
# a GCS port among them makes Ray refuse to start ("trying to use a port number ... that is
# used by other components"). The dashboard's is reserved even with the dashboard off.
RAY_WORKER_PORTS = range(10002, 20000)  # --min-worker-port .. --max-worker-port
RAY_FIXED_PORTS = {8265: "the Ray dashboard", 10001: "the Ray client server",
                   52365: "the Ray dashboard agent"}


def _check_ray_port(port: int, http_port: int) -> None:
    """The GCS port of the head is none of the ports Ray or the endpoint takes there."""
    if port in RAY_WORKER_PORTS:
        why = "is in Ray's worker port range 10002-19999: Ray refuses to start its head"
    elif port in RAY_FIXED_PORTS:
        why = f"is the port of {RAY_FIXED_PORTS[port]}: Ray refuses to start its head"
    elif port == http_port:
        why = "is also experiment.runner.deploy.port, the endpoint's port on the head"
    else:
        return
    raise ConfigError("experiment.runner.ray_port", f"{port} {why}",
                      "use 6379 (the default) or another free port outside 10001-19999 "
                      "(and not 8265 or 52365)")


def _check_engine_envs(exp: ExperimentConfig) -> None:
    """The engine's settings in experiment.envs, checked as the engine will read them (a bad
    one would fail the engine's start under `run`, after the model loads)."""
    for name, text in exp.exported_envs().items():
        value = exp.envs[name]
        if name in SETTINGS and text not in (choices := get_args(SETTINGS[name])):
            quote = " (YAML reads a bare on/off as a boolean: quote it)" if isinstance(value, bool) \
                else ""
            raise ConfigError(f"experiment.envs.{name}", f"must be one of {', '.join(choices)}, "
                              f"got {text!r}{quote}", f"set experiment.envs.{name}={choices[0]}")
        if name == BIND_ENV and text not in ("auto", "off", ""):
            _check_bind(exp, name, text)


def _check_bind(exp: ExperimentConfig, name: str, text: str) -> None:
    """A malformed core list; on this host alone (no hostfile), cores it does not have."""
    try:
        cpus = parse_cpu_list(text)
    except ValueError as err:
        raise ConfigError(f"experiment.envs.{name}", str(err), "e.g. 0-1, or auto") from None
    here = sorted(os.sched_getaffinity(0))
    outside = [c for c in cpus if c not in here]
    if outside and not exp.runner.hostfile:
        raise ConfigError(f"experiment.envs.{name}", f"names cores {outside[:8]} that this host "
                          f"does not run on; its cores: {','.join(map(str, here))}",
                          "name cores among those, or auto")


def _check_limits(limits: ApiLimits) -> None:
    for key, value in dataclasses.asdict(limits).items():
        if value is not None and value < 1:
            default = getattr(ApiLimits(), key)
            raise ConfigError(f"experiment.runner.deploy.limits.{key}", f"must be >= 1, got {value}",
                              f"raise it (default {default})" if default is not None
                              else "raise it, or set it to null (the default: no limit)")


def validate_graph(config: Config, hosts: list[Host]) -> None:
    """Everything `run`, `test` and `plan` need: modules, files, dependencies, devices."""
    if not config.llms:
        raise ConfigError("serve", "has no LLM module",
                          "add one, e.g. serve.llm.engine_args.model=/path/to/hf_model")
    names: dict[str, str] = {}
    for module_id, module in config.serve.items():
        if not NAME_RE.match(module_id):
            raise ConfigError(f"serve.{module_id}", "module ids must be simple names",
                              "use letters, digits, '.', '_' and '-' only")
        if isinstance(module, LLMModule):
            _check_llm(module_id, module)
            for name in served_names(module_id, module):
                # module ids are `model` values too (the ingress routes by either)
                other = names.setdefault(name, module_id) if name not in config.serve else name
                if other != module_id:
                    raise ConfigError(f"serve.{module_id}.model_name",
                                      f"{name!r} is also served by serve.{other}",
                                      f"set a distinct serve.{module_id}.model_name")
            _check_resources(f"serve.{module_id}.tokenizer", module.tokenizer, min_replicas=0)
            _check_router(f"serve.{module_id}.router", module.router)
            check_disaggregation(config, module_id, module, hosts)
        else:
            _check_user_module(module_id, module)
        _check_resources(f"serve.{module_id}.resources", module.resources)
    _check_depends(config)
    _check_ingress(config)
    _check_devices(config, hosts)


def _check_ingress(config: Config) -> None:
    deploy = config.deploy
    if deploy.http_server == "replicas" and ingress_autoscales(config):
        raise ConfigError("experiment.runner.deploy.http_server",
                          "`replicas` bypasses Ray Serve's proxy, whose request counts drive "
                          "autoscaling",
                          "set experiment.runner.deploy.http_server=serve_proxy (or auto), or a "
                          "fixed num_replicas")
    if deploy.ingress != "engine":
        return
    if len(config.llms) != 1:
        raise ConfigError("experiment.runner.deploy.ingress",
                          f"`engine` needs exactly one LLM module, the graph has {len(config.llms)}",
                          "set experiment.runner.deploy.ingress=separate (or auto) to route "
                          "between models")
    if deploy.ingress_replicas != 1:
        raise ConfigError("experiment.runner.deploy.ingress_replicas",
                          "applies to a separate ingress; with ingress=engine every engine "
                          "replica serves HTTP",
                          f"scale serve.{next(iter(config.llms))}.resources.num_replicas instead, "
                          "or set experiment.runner.deploy.ingress=separate")


def _check_llm(module_id: str, module: LLMModule) -> None:
    path = f"serve.{module_id}"
    model = module.engine_args.get("model")
    if not model:
        raise ConfigError(f"{path}.engine_args.model", "is not set",
                          f"set {path}.engine_args.model=/path/to/hf_model_dir or /path/to/model.gguf "
                          f"(or {path}.builtin_model=smollm2-135m-instruct, or {path}.tiny_model=llama)")
    model_cfg = _model_config(f"{path}.engine_args.model", Path(str(model)))
    tokenizer = module.engine_args.get("tokenizer")
    if tokenizer and not Path(str(tokenizer)).exists():
        raise ConfigError(f"{path}.engine_args.tokenizer", f"{tokenizer!r} does not exist",
                          "point it at a local tokenizer directory or .gguf file, or set it to "
                          "null for the model's own")
    max_len = module.engine_args.get("max_model_len")
    if isinstance(max_len, int) and max_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"{path}.engine_args.max_model_len",
                          f"{max_len} exceeds the model's {model_cfg.positions_text}",
                          f"set {path}.engine_args.max_model_len <= {model_cfg.max_position_embeddings}")
    for name in PARALLEL_ARGS:
        value = module.engine_args.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{path}.engine_args.{name}", f"must be an integer >= 1, got {value!r}",
                              f"set {path}.engine_args.{name}=1")
    if module.engine_core == "process" and module.world_size > 1:
        raise ConfigError(f"{path}.engine_core", "`process` needs TP = PP = 1: with shard "
                          "workers the replica drives them from its own step thread",
                          f"set {path}.engine_core=auto (or thread)")
    try:
        engine_args_for(module).check_parallelism(model_cfg)
    except (ValueError, TypeError) as err:
        match = re.match(r"EngineArgs\.(\w+) (.*)", str(err))
        key, message = (match.group(1), match.group(2)) if match else ("", str(err))
        raise ConfigError(f"{path}.engine_args{'.' + key if key else ''}", message,
                          _parallel_fix(key, model_cfg)) from None


def _parallel_fix(key: str, cfg: ModelConfig) -> str:
    """The sizes this model splits into: TP must divide the heads, KV heads and MLP width."""
    if key == "tensor_parallel_size":
        width = math.gcd(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
        sizes = [n for n in range(1, width + 1) if width % n == 0][:8]
        return f"use one of {', '.join(map(str, sizes))}"
    if key == "pipeline_parallel_size":
        return f"use at most {cfg.num_hidden_layers} (the model's layers)"
    return "see `EngineArgs` in flagserve/engine/engine_args.py"


def _model_config(key: str, model: Path) -> ModelConfig:
    """The model's config; a missing or unservable checkpoint is a ConfigError naming it."""
    if model_format(model) == "gguf":
        try:
            return load_model_config(model)
        except ValueError as err:  # missing, truncated, corrupt, unsupported: the reader says which
            raise ConfigError(key, str(err), "point it at a complete .gguf file of one of: "
                              f"{', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3)") from None
    if not model.is_dir():
        raise ConfigError(key, f"directory {str(model)!r} does not exist",
                          "point it at a local Hugging Face model directory (config.json + "
                          "*.safetensors + tokenizer) or a .gguf file; nothing is downloaded")
    if not (model / "config.json").is_file():
        raise ConfigError(key, f"{str(model)!r} has no config.json",
                          "point it at a Hugging Face model directory or a .gguf file")
    try:
        return load_model_config(model)
    except ValueError as err:
        raise ConfigError(key, f"cannot serve {str(model)!r}: {err}",
                          "serve a complete checkpoint (config.json as transformers writes it) "
                          f"of one of: {', '.join(HF_ARCHITECTURES)}") from None


def _check_user_module(module_id: str, module: UserModule) -> None:
    path = f"serve.{module_id}"
    file = Path(module.module)
    if not module.module or not file.is_file():
        raise ConfigError(f"{path}.module", f"file {module.module!r} does not exist",
                          "point it at the .py file that defines your class")
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except SyntaxError as err:
        raise ConfigError(f"{path}.module", f"{file} does not parse: {err}", "fix the file") from None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if module.name not in classes:
        raise ConfigError(f"{path}.name", f"no class {module.name!r} in {file}",
                          f"use one of: {', '.join(classes) or '(no classes defined)'}")
    accepted = _init_keywords(classes[module.name])
    unknown = sorted(set(module.init_args) - accepted) if accepted is not None else []
    if unknown:  # found here, not 20 s into a deployment
        raise ConfigError(f"{path}.init_args.{unknown[0]}",
                          f"{module.name}.__init__ takes no argument {unknown[0]!r}",
                          f"use one of: {', '.join(sorted(accepted)) or '(none)'}")


def _init_keywords(cls: ast.ClassDef) -> set[str] | None:
    """The keyword arguments the class's own __init__ takes; None when that cannot be read
    from the source (inherited, **kwargs, a decorator)."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                None)
    if init is None:
        return set() if not cls.bases and not cls.decorator_list else None
    if init.args.kwarg is not None or init.decorator_list:
        return None
    return {a.arg for a in [*init.args.args[1:], *init.args.kwonlyargs]}


def _check_resources(path: str, res: ResourcesConfig, min_replicas: int = 1) -> None:
    if res.num_replicas < min_replicas:
        fix = "e.g. 1" if min_replicas else "0 (tokenize in the ingress) or more replicas"
        raise ConfigError(f"{path}.num_replicas",
                          f"must be >= {min_replicas}, got {res.num_replicas}", fix)
    lo, hi = res.min_replicas, res.max_replicas
    if res.autoscaling:
        if lo is None or hi is None:
            raise ConfigError(f"{path}.{'max' if hi is None else 'min'}_replicas",
                              "autoscaling needs both min_replicas and max_replicas",
                              "set both, or neither for a fixed num_replicas")
        if lo < 0 or hi < 1 or lo > hi:
            raise ConfigError(f"{path}.min_replicas", f"need 0 <= min_replicas <= max_replicas "
                              f"and max_replicas >= 1, got {lo}..{hi}", "e.g. min 1, max 4")
    for name in ("num_cpus", "num_gpus"):
        value = getattr(res, name)
        if value is not None and value < 0:
            raise ConfigError(f"{path}.{name}", f"must be >= 0, got {value:g}", "e.g. 1")
    if (target := res.target_ongoing_requests) is not None and not target > 0:
        # (0 was taken for unset: the default target replaced it without a word)
        raise ConfigError(f"{path}.target_ongoing_requests", f"must be > 0, got {target:g}",
                          "e.g. 8, or null for the default (the engine's max_num_seqs)")
    if res.max_ongoing_requests is not None and res.max_ongoing_requests < 1:
        raise ConfigError(f"{path}.max_ongoing_requests", "must be >= 1", "e.g. 256")


def _check_router(path: str, router: RouterConfig) -> None:
    default = RouterConfig()
    for name, low, strict in (("prefix_blocks", 1, False), ("max_imbalance", 0, False),
                              ("kv_usage_weight", 0, False), ("stats_period_s", 0, True)):
        value = getattr(router, name)
        if value < low or (strict and value == low):
            raise ConfigError(f"{path}.{name}", f"must be {'>' if strict else '>='} {low}, got {value}",
                              f"e.g. {getattr(default, name)} (the default)")


def _check_depends(config: Config) -> None:
    for module_id, module in config.serve.items():
        for dep in module.depends:
            if dep not in config.serve:
                raise ConfigError(f"serve.{module_id}.depends", f"names unknown module {dep!r}",
                                  f"use one of: {', '.join(sorted(config.serve))}")
            if dep == module_id:
                raise ConfigError(f"serve.{module_id}.depends", "a module cannot depend on itself",
                                  f"remove {module_id!r} from the list")
            if isinstance(config.serve[dep], LLMModule):
                raise ConfigError(f"serve.{module_id}.depends",
                                  f"{dep!r} is an LLM; `depends` lists user modules whose output "
                                  "feeds this module", f"make serve.{dep}.depends list "
                                  f"{module_id!r} instead, if {module_id!r} preprocesses its requests")
    cycle = find_cycle({mid: m.depends for mid, m in config.serve.items()})
    if cycle:
        raise ConfigError(f"serve.{cycle[0]}.depends", f"dependency cycle: {' -> '.join(cycle)}",
                          "remove one of these dependencies")


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in graph.get(node, []):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return None


def _check_devices(config: Config, hosts: list[Host]) -> None:
    capacity = sum(h.num_gpus for h in hosts)
    largest = max((h.num_gpus for h in hosts), default=0)
    demand = 0
    for group in engine_groups(config):  # a disaggregated module: each role's replicas
        module_id, module = group.module_id, group.module
        path = f"serve.{module_id}"
        if not uses_gpu(module, hosts):
            continue
        if capacity == 0:
            raise ConfigError(f"{path}.engine_args.device", "asks for a GPU but no host has one",
                              f"set {path}.engine_args.device=cpu, or list GPU hosts in a hostfile")
        if module.tensor_parallel_size > largest:
            raise ConfigError(f"{path}.engine_args.tensor_parallel_size",
                              f"{module.tensor_parallel_size} ranks must share one host, and the "
                              f"largest host has {largest} GPUs",
                              f"use tensor_parallel_size <= {largest} and raise "
                              "pipeline_parallel_size to span hosts")
        res = module.resources
        replicas = res.min_replicas if res.autoscaling and res.min_replicas else res.num_replicas
        demand += module.world_size * max(replicas, 1)
        if res.num_gpus is not None and res.num_gpus not in (0, module.world_size):
            where = f"{path}.disaggregation.{group.role}" if group.role else path
            raise ConfigError(f"{where}.resources.num_gpus",
                              f"{res.num_gpus} does not match tensor x pipeline parallel size "
                              f"({module.world_size} GPUs per replica)", "remove it: it is derived")
    if demand > capacity:
        raise ConfigError("serve", f"the modules ask for {demand} GPUs (TP x PP x replicas) but "
                          f"the hosts have {capacity}",
                          "lower tensor/pipeline_parallel_size or num_replicas, or add hosts "
                          "in experiment.runner.hostfile")
