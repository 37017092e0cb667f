"""action=plan: validate, then print where every module goes and its memory per device."""
from __future__ import annotations

from collections import defaultdict

from flagserve.config.errors import ConfigError
from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule
from flagserve.config.topology import (
    EngineGroup,
    direct_http,
    engine_core_mode,
    engine_groups,
    ingress_in_engine,
    role_scaling,
    served_names,
    several_replicas,
    uses_gpu,
)
from flagserve.runner.deployment import Deployment
from flagserve.runner.memory import estimate
from flagserve.runner.placement import place


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _replicas(res) -> str:
    if res.autoscaling:
        return f"{res.min_replicas}..{res.max_replicas} (autoscaling)"
    return str(res.num_replicas)


def print_plan(deployment: Deployment) -> None:
    config, hosts = deployment.config, deployment.hosts
    exp = config.experiment
    head = hosts[0]
    gpus = sum(h.num_gpus for h in hosts)
    print(f"plan for {exp.exp_name}: {len(hosts)} host(s), {gpus} GPU(s); head {head.address}; "
          f"exp_dir {exp.exp_dir}")
    for h, role in deployment.roles():
        kind = f"{h.num_gpus} GPU(s)" if h.num_gpus else f"{h.slots} CPU slot(s)"
        print(f"  host {h.address:<22} {role}, {kind}, resource host:{h.address}")
    print(f"  {'deployment':<24} {'replicas':<18} placement")
    url = deployment.endpoint
    local = ingress_in_engine(config)
    via = "each replica listens on the port" if direct_http(config) else "through Ray Serve's proxy"
    if local is None:
        print(f"  {'ingress':<24} {config.deploy.ingress_replicas!s:<18} any host (CPU), "
              f"OpenAI API at {url}/v1 ({via})")
    else:
        print(f"  OpenAI API at {url}/v1, served by every {local}-engine replica ({via})")
    print(f"  {'metrics':<24} {'1':<18} {head.address} (CPU)")
    for mid, m in config.user_modules.items():
        print(f"  {mid:<24} {_replicas(m.resources):<18} any host (CPU), {m.name} from {m.module}")
    for mid, m in config.llms.items():
        if m.tokenizer_deployment:
            print(f"  {mid + '-tokenizer':<24} {_replicas(m.tokenizer):<18} any host (CPU)")
    _print_engines(config, hosts, local)
    for group in engine_groups(config):
        _print_memory(group, uses_gpu(group.module, hosts), config.experiment.exported_envs())


def _print_engines(config: Config, hosts: list[Host], local: str | None) -> None:
    shards = defaultdict(list)
    for s in place(config, hosts):
        shards[s.engine].append(s)
    for group in engine_groups(config):
        mid, m = group.module_id, group.module
        layout = f"TP {m.tensor_parallel_size} x PP {m.pipeline_parallel_size}"
        routed = f", routed {m.router.strategy}" if mid != local and several_replicas(m) else ""
        role = ""
        if group.role == "prefill":
            role = (", prefill: hands each request after its first token to "
                    f"{mid}-decode, KV over {_kv_mode(config.llms[mid], hosts)}")
        elif group.role == "decode":
            role = f", decode: continues {mid}-prefill's requests"
        if group.role and (scaling := role_scaling(config.llms[mid], group.role, hosts)):
            role += (f", scaled on {scaling.metric.replace('_', ' ')} "
                     f"(target {scaling.target:g} per replica)")
        print(f"  {group.name:<24} {_replicas(m.resources):<18} {layout}, "
              f"model {', '.join(served_names(mid, m))}, step loop in a {engine_core_mode(m)}"
              f"{routed}{role}")
        for s in shards[group.name]:
            where = f"gpu {','.join(map(str, s.devices))}" if uses_gpu(m, hosts) else "cpu"
            print(f"  {'':<24} {'':<18} replica {s.replica} stage {s.stage}: {s.host} {where}")


def _kv_mode(module: LLMModule, hosts: list[Host]) -> str:
    mode = module.disaggregation.kv_transfer
    if mode == "auto":
        mode = "nccl" if uses_gpu(module, hosts) else "gloo"
    return f"{mode} (engine to engine)"


def _print_memory(group: EngineGroup, gpu: bool, envs: dict[str, str]) -> None:
    est = estimate(group.module_id, group.module, gpu, envs)
    args = f"serve.{group.module_id}" + (f".disaggregation.{group.role}" if group.role else "")
    print(f"memory per device of {group.name} ({est.model.architecture}, {est.dtype}, "
          f"{_count(est.num_params)} parameters, {'GPU' if gpu else 'CPU'}):")
    print(f"  weights   {_gib(est.weights_bytes)}")
    print(f"  KV cache  {_gib(max(est.kv_budget_bytes, 0))} from {est.budget_source}: "
          f"{est.kv_tokens:,} tokens at {est.kv_bytes_per_token / 1024:.1f} KiB/token "
          f"(max_model_len {est.max_model_len:,})")
    if est.too_small and est.budget_key is not None:  # what the engine will count: it refuses
        raise ConfigError(f"{args}.engine_args.{est.budget_key}",
                          f"the KV cache holds {est.kv_tokens:,} tokens, fewer than max_model_len "
                          f"({est.max_model_len:,}): the engine would refuse to start",
                          f"raise it, or lower {args}.engine_args.max_model_len")
    if est.too_small:
        print(f"  WARNING: the KV cache holds fewer tokens than max_model_len; the engine will "
              f"refuse to start: lower {args}.engine_args.max_model_len or give it more memory")
