"""FlagScale's prefill/decode switches of experiment.runner.deploy, mapped onto the LLM module:

    prefill_decode_disaggregation: true  ->  serve.<id>.disaggregation
    prefill_num: P, decode_num: D        ->  .prefill.num_replicas: P, .decode.num_replicas: D
    prefill_address, decode_address      ->  .prefill.host, .decode.host (auto: null)
    prefill_decode_strategy              ->  serve.<id>.router.strategy (the nearest one)

FlagScale splits the one model it serves; here that is the graph's one LLM module. Each
mapping is reported as a note.
"""
from __future__ import annotations

from typing import Any

from flagserve.config.errors import ConfigError

DEPLOY = "experiment.runner.deploy"
# FlagScale's proxy picks instances by: slo (fewest queued prompt tokens), robin (fewest
# requests, despite the name), random. FlagServe's router weighs running + waiting requests
# and KV usage (least_loaded); random spreading is closest to round_robin.
STRATEGIES = {"slo": "least_loaded", "robin": "least_loaded", "random": "round_robin"}
COUNTS = {"prefill_num": "prefill", "decode_num": "decode"}
# Written by FlagScale's own runner for its proxy and logs: nothing to map.
RUNNER_ONLY = ("pd_proxy_port", "prefill_decode_log_dir")
ADDRESSES = {"prefill_address": "prefill", "decode_address": "decode"}
KEYS = ("prefill_decode_disaggregation", "prefill_decode_strategy", *COUNTS, *RUNNER_ONLY,
        *ADDRESSES)


def map_disaggregation(deploy: dict[str, Any], serve: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Remove FlagScale's keys from `deploy` (returned as a new dict) and apply them to the
    LLM module of `serve` (in place)."""
    keys = {k: deploy[k] for k in KEYS if k in deploy}
    if not keys:
        return deploy
    rest = {k: v for k, v in deploy.items() if k not in keys}
    enabled = keys.get("prefill_decode_disaggregation", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{DEPLOY}.prefill_decode_disaggregation",
                          f"must be true/false, got {enabled!r}", "true to split prefill and decode")
    if not enabled:
        ignored = sorted(set(keys) - {"prefill_decode_disaggregation"})
        if ignored:
            notes.append(f"{DEPLOY}: ignoring {', '.join(ignored)} "
                         "(prefill_decode_disaggregation is off)")
        return rest
    module_id, module = _the_llm(serve)
    split = dict(module.get("disaggregation") or {})
    for key, role in COUNTS.items():
        if key in keys:
            split[role] = {**(split.get(role) or {}), "num_replicas": _count(key, keys[key])}
            notes.append(f"{DEPLOY}.{key}={keys[key]} -> "
                         f"serve.{module_id}.disaggregation.{role}.num_replicas")
    for key, role in ADDRESSES.items():
        if keys.get(key, "auto") != "auto":
            split[role] = {**(split.get(role) or {}), "host": str(keys[key])}
            notes.append(f"{DEPLOY}.{key}={keys[key]} -> serve.{module_id}.disaggregation.{role}.host")
    module["disaggregation"] = split
    dropped = [k for k in RUNNER_ONLY if k in keys]
    if dropped:
        notes.append(f"{DEPLOY}: dropping {', '.join(dropped)} (FlagScale's proxy and logs: "
                     "the ingress routes and the run's logs are under exp_dir/logs)")
    if "prefill_decode_strategy" in keys:
        module["router"] = {**(module.get("router") or {}),
                            "strategy": _strategy(module_id, keys["prefill_decode_strategy"], notes)}
    notes.append(f"{DEPLOY}.prefill_decode_disaggregation -> serve.{module_id}.disaggregation")
    return rest


def _the_llm(serve: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    llms = [mid for mid, m in serve.items() if isinstance(m, dict) and "module" not in m]
    if len(llms) != 1:
        raise ConfigError(f"{DEPLOY}.prefill_decode_disaggregation",
                          f"splits the one model of a FlagScale experiment; this graph has "
                          f"{len(llms)} LLM modules", "set serve.<id>.disaggregation on the "
                          "module to split instead")
    return llms[0], serve[llms[0]]


def _count(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{DEPLOY}.{key}", f"must be an integer >= 1, got {value!r}", "e.g. 1")
    return value


def _strategy(module_id: str, value: Any, notes: list[str]) -> str:
    if value not in STRATEGIES:
        raise ConfigError(f"{DEPLOY}.prefill_decode_strategy", f"unknown value {value!r}",
                          f"use one of: {', '.join(STRATEGIES)} (or set "
                          f"serve.{module_id}.router.strategy)")
    notes.append(f"{DEPLOY}.prefill_decode_strategy={value} -> "
                 f"serve.{module_id}.router.strategy={STRATEGIES[value]}")
    return STRATEGIES[value]
