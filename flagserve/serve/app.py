"""The serving graph: config modules -> Ray Serve deployments, wired by `depends`.

deploy.ingress = engine (the default with one LLM module): every engine replica serves HTTP

    <id>-engine (OpenAI API, tokenizes, engine in process) -> [user modules, dependencies first]
                                                          (-> shard workers, TP x PP)

deploy.ingress = separate (several LLM modules, several engine replicas, or ingress_replicas > 1):

    ingress (OpenAI API, tokenizes) -> [user modules of the model, dependencies first]
                                    -> <id>-engine (-> shard workers, TP x PP)
                                       the replica picked by serve.<id>.router (serve/routing)

serve.<id>.disaggregation (always a separate ingress): two engine deployments, the ingress
passing each request's handoff from one to the other (serve/disagg_client.py)

    ingress -> <id>-prefill (prompt, first token) -> handoff -> <id>-decode (the rest)
               <id>-prefill ==== KV, engine to engine (gloo / NCCL) ====> <id>-decode
               (each a deployment of any number of replicas, picked by its router)

HTTP reaches the ingress replicas straight (deploy.http_server = replicas, the default on one
host: each listens on host:port) or through Ray Serve's proxy on the head (serve_proxy).
Either way: with tokenizer.num_replicas > 0 the ingress asks <id>-tokenizer instead of
tokenizing, and every engine replica pushes its metrics to `metrics` (one replica), which
/metrics renders.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from flagserve.config.hostfile import Host
from flagserve.config.schema import Config, LLMModule, ResourcesConfig
from flagserve.config.topology import (
    RoleScaling,
    direct_http,
    engine_core_mode,
    engine_groups,
    ingress_in_engine,
    role_module,
    role_scaling,
    served_engine_args,
    served_names,
    uses_gpu,
)
from flagserve.distributed.placement import HOST_RESOURCE_AMOUNT, host_resource
from flagserve.engine.cpu_runtime import replica_cpus
from flagserve.entrypoints.openai.ingress import ModelRoute, OpenAIIngress
from flagserve.serve.autoscaling import autoscaling_options
from flagserve.serve.disagg_client import DisaggregatedEngineSpec
from flagserve.serve.disagg_deployments import DecodeDeployment, PrefillDeployment
from flagserve.serve.engine_clients import LocalEngineSpec, RemoteEngineSpec
from flagserve.serve.engine_deployment import EngineDeployment
from flagserve.serve.metrics_hub import HUB_NAME, MetricsHub
from flagserve.serve.routing.ray_router import EngineRouter
from flagserve.serve.tokenizer_deployment import TokenizerDeployment
from flagserve.serve.user_module import UserModuleDeployment

# A stopping replica drains (deploy.drain_timeout_s: the ingress's __del__, drain.py, or
# Serve itself waiting for requests that came through it), then ends what is left and stops
# its engine; Serve kills it this much after the drain timeout.
SHUTDOWN_MARGIN_S = 10.0
SHUTDOWN_WAIT_LOOP_S = 0.5  # how often Serve looks at a stopping replica's ongoing requests
CONSTRUCTOR_RETRIES = 2  # a model that fails to load fails `run` quickly, not after 20 tries
# Serve restarts a replica after 3 failed health checks in a row: a dead engine is replaced
# in about 6 s instead of Serve's default 30 s (checking is one cheap call per period).
ENGINE_HEALTH_CHECK_S = 2.0


def deployment_options(res: ResourcesConfig, num_cpus: float, num_gpus: float = 0,
                       max_ongoing: int = 1024, target_ongoing: float = 64,
                       scaling: RoleScaling | None = None) -> dict[str, Any]:
    """Serve's options of a deployment; autoscaled on ongoing requests (Serve's default
    policy), or, for a role of a disaggregated module, on the load `scaling` names."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": res.num_cpus if res.num_cpus is not None else num_cpus,
                              "num_gpus": num_gpus},
        "max_ongoing_requests": res.max_ongoing_requests or max_ongoing,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
    }
    if res.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": res.min_replicas, "max_replicas": res.max_replicas,
            "initial_replicas": max(res.min_replicas or 0, 1),
            "target_ongoing_requests": res.target_ongoing_requests or target_ongoing,
            **(autoscaling_options(scaling) if scaling is not None else {})}
    else:
        options["num_replicas"] = res.num_replicas
    return options


def engine_options(module: LLMModule, hosts: list[Host], cpu_engines: int = 1,
                   scaling: RoleScaling | None = None) -> dict[str, Any]:
    max_num_seqs = int(module.engine_args.get("max_num_seqs", 256))
    gpu = uses_gpu(module, hosts)
    # TP x PP > 1: the shard workers (their own placement group) hold the devices; the engine
    # replica only schedules and drives them.
    sharded = module.world_size > 1
    # On one host a CPU engine replica owns its share of the cores (its torch threads: one
    # per core it owns, engine/cpu_runtime.py); other hosts' core counts are unknown here.
    host_cpus = os.cpu_count() or 1
    cpus = replica_cpus(host_cpus, cpu_engines) if len(hosts) == 1 else 1
    options = deployment_options(module.resources, num_cpus=0 if gpu or sharded else cpus,
                                 num_gpus=1 if gpu and not sharded else 0,
                                 max_ongoing=4 * max_num_seqs, target_ongoing=max_num_seqs,
                                 scaling=scaling)
    return {**options, "health_check_period_s": ENGINE_HEALTH_CHECK_S}


def router_config(module: LLMModule, model_name: str, block_size: int) -> RequestRouterConfig:
    """How the ingress's handle picks among this module's engine replicas (serve.<id>.router;
    why Serve's extension point: flagserve/serve/routing/ray_router.py)."""
    router = module.router
    return RequestRouterConfig(
        request_router_class=EngineRouter,
        request_router_kwargs={"router": dataclasses.asdict(router), "block_size": block_size,
                               "model_name": model_name},
        request_routing_stats_period_s=router.stats_period_s,
        # Serve's default (30 s) would keep a hung replica's stale load for that long.
        request_routing_stats_timeout_s=max(5.0, 5 * router.stats_period_s))


def cpu_engine_replicas(config: Config, hosts: list[Host]) -> int:
    """Engine replicas that run a model on this host's CPU cores (at most, when autoscaled)."""
    return sum(max(m.resources.num_replicas, m.resources.max_replicas or 0)
               for m in (g.module for g in engine_groups(config))
               if m.world_size == 1 and not uses_gpu(m, hosts) and m.resources.num_cpus is None)


def disaggregated_engine(config: Config, hosts: list[Host], module_id: str, model_name: str,
                         options: dict[str, Any]) -> DisaggregatedEngineSpec:
    """<id>-prefill and <id>-decode, linked for KV transfer: each prefill replica binds its
    own endpoint, each decode replica connects to those it receives from (disagg_deployments)."""
    cpu_engines, hub = options.pop("cpu_engines"), options.pop("hub")
    module = config.llms[module_id]
    link = {"mode": module.disaggregation.kv_transfer, "address": None}
    handles = []
    for role, cls in (("prefill", PrefillDeployment), ("decode", DecodeDeployment)):
        m = role_module(module, role)
        args = {**served_engine_args(m, hosts).to_dict(), "kv_transfer": {**link, "role": role}}
        placed = engine_options(m, hosts, cpu_engines, role_scaling(module, role, hosts))
        if (host := getattr(module.disaggregation, role).host) is not None:
            # disaggregation.<role>.host: every node of the multi-host runner advertises its own
            placed["ray_actor_options"]["resources"] = {host_resource(host): HOST_RESOURCE_AMOUNT}
        handles.append(serve.deployment(cls).options(
            name=f"{module_id}-{role}", **placed, **options,
            request_router_config=router_config(m, model_name, args["block_size"])
        ).bind(module_id, model_name, args, hub, engine_core_mode(m)))
    return DisaggregatedEngineSpec(*handles)


def shutdown_options(config: Config) -> dict[str, float]:
    """Serve's graceful shutdown settings of every deployment of the graph."""
    return {"graceful_shutdown_timeout_s": config.deploy.drain_timeout_s + SHUTDOWN_MARGIN_S,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S}


def ingress_name(config: Config) -> str:
    """The deployment whose replicas serve HTTP: the engine's, or an ingress of its own."""
    local = ingress_in_engine(config)
    return f"{local}-engine" if local is not None else "ingress"


def dependency_order(config: Config, module_id: str) -> list[str]:
    """User modules that feed `module_id`, each after its own dependencies."""
    order: list[str] = []

    def visit(mid: str) -> None:
        for dep in config.serve[mid].depends:
            if dep not in order:
                visit(dep)
                order.append(dep)

    visit(module_id)
    return order


def build_app(config: Config, hosts: list[Host]) -> Application:
    stop = shutdown_options(config)
    # Its calls are the replicas' pushes (twice a second under load, a heartbeat every 10 s
    # idle) and scrapes: Serve's access log line for each would fill server.log.
    hub = serve.deployment(MetricsHub).options(
        name=HUB_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False}).bind()
    users = {
        mid: serve.deployment(UserModuleDeployment).options(
            name=mid, **deployment_options(m.resources, num_cpus=0), **stop
        ).bind(mid, m.module, m.name, m.init_args)
        for mid, m in config.user_modules.items()}
    local = ingress_in_engine(config)
    cpu_engines = cpu_engine_replicas(config, hosts)
    routes = []
    for mid, module in config.llms.items():
        names = served_names(mid, module)
        tokenizer_path = module.engine_args.get("tokenizer") or module.engine_args["model"]
        tokenizer = None
        if module.tokenizer_deployment:
            tokenizer = serve.deployment(TokenizerDeployment).options(
                name=f"{mid}-tokenizer", **deployment_options(module.tokenizer, num_cpus=0), **stop
            ).bind(tokenizer_path)
        engine_args = served_engine_args(module, hosts).to_dict()  # placement fields stay here
        if mid == local:
            engine = LocalEngineSpec(mid, names[0], engine_args, engine_core_mode(module))
        elif module.disaggregation is not None:
            engine = disaggregated_engine(config, hosts, mid, names[0],
                                          {**stop, "cpu_engines": cpu_engines, "hub": hub})
        else:
            engine = RemoteEngineSpec(serve.deployment(EngineDeployment).options(
                name=f"{mid}-engine", **engine_options(module, hosts, cpu_engines), **stop,
                request_router_config=router_config(module, names[0], engine_args["block_size"])
            ).bind(mid, names[0], engine_args, hub, engine_core_mode(module)))
        routes.append(ModelRoute(mid, names, engine, tokenizer_path, tokenizer,
                                 [(d, users[d]) for d in dependency_order(config, mid)],
                                 module.tool_call_parser))
    if local is not None:
        options = {"name": ingress_name(config),
                   **engine_options(config.llms[local], hosts, cpu_engines)}
    else:
        options = {"name": ingress_name(config), "num_replicas": config.deploy.ingress_replicas,
                   "max_ongoing_requests": 4096, "ray_actor_options": {"num_cpus": 0}}
    listen = (config.deploy.host, config.deploy.port) if direct_http(config) else None
    return serve.deployment(serve.ingress()(OpenAIIngress)).options(**options, **stop).bind(
        routes, config.api_key, hub, listen, config.deploy.drain_timeout_s,
        limits=config.deploy.limits, docs=config.deploy.docs)
