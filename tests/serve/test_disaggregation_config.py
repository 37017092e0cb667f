"""serve.<id>.disaggregation and FlagScale's prefill/decode keys: what `plan` shows of both
roles, every bad case as one ConfigError naming the key (exit code 2), and the mapping."""
from __future__ import annotations

import dataclasses
import re

import pytest

from flagserve.config import parse_config
from flagserve.config.errors import ConfigError
from flagserve.runner.cli import EXIT_CONFIG
from tests.serve.test_config import run

SPLIT = "+serve.llm.disaggregation.prefill.num_replicas=1"


def test_plan_shows_both_roles_and_their_kv_budgets(capsys):
    code, out, err = run(capsys, "+serve.llm.disaggregation.prefill.num_replicas=2",
                         "+serve.llm.disaggregation.decode.engine_args.num_kv_blocks=200")
    assert code == 0, err
    assert re.search(r"ingress\s+1\s", out), out  # the ingress carries the handoff
    assert re.search(r"llm-prefill\s+2\s.*hands each request.*to llm-decode, KV over gloo", out), out
    assert "replica 1 stage 0" in out.split("\n  llm-decode")[0], out  # xPyD: 2 prefill replicas
    assert re.search(r"llm-decode\s+1\s.*continues llm-prefill's requests", out), out
    assert "llm-engine" not in out
    memory = out.split("memory per device of llm-prefill")[1]
    prefill, decode = memory.split("memory per device of llm-decode")
    assert "cpu_kv_cache_space_gib=0.5" in prefill  # the module's budget
    assert "num_kv_blocks=200: 3,200 tokens" in decode  # the role's own


def test_plan_shows_what_each_autoscaled_role_scales_on(capsys):
    code, out, err = run(capsys, *(f"+serve.llm.disaggregation.{role}.{key}={value}"
                                   for role in ("prefill", "decode")
                                   for key, value in (("min_replicas", 1), ("max_replicas", 3))))
    assert code == 0, err
    assert re.search(r"llm-prefill\s+1\.\.3 \(autoscaling\).*scaled on queued prompt tokens "
                     r"\(target 4096 per replica\)", out), out
    assert re.search(r"llm-decode\s+1\.\.3 \(autoscaling\).*scaled on running requests", out), out


@pytest.mark.parametrize("overrides,key,words", [
    (["+serve.llm.disaggregation.prefill.num_replicas=0"],
     "serve.llm.disaggregation.prefill.num_replicas", ">= 1"),
    ([SPLIT, "+serve.llm.disaggregation.decode.engine_args.block_size=32"],
     "serve.llm.disaggregation.decode.engine_args.block_size", "same for both roles"),
    ([SPLIT, "+serve.llm.disaggregation.decode.engine_args.max_num_seq=8"],
     "serve.llm.disaggregation.decode.engine_args.max_num_seq", "did you mean `max_num_seqs`"),
    ([SPLIT, "+serve.llm.disaggregation.prefill.engine_args.max_num_seqs=-3"],
     "serve.llm.disaggregation.prefill.engine_args.max_num_seqs", "must be an integer >= 1"),
    ([SPLIT, "+serve.llm.disaggregation.decode.replicas=2"],
     "serve.llm.disaggregation.decode.replicas", "did you mean `num_replicas`"),
    ([SPLIT, "+serve.llm.disaggregation.kv_transfer=rdma"],
     "serve.llm.disaggregation.kv_transfer", "auto, gloo, nccl"),
    ([SPLIT, "+serve.llm.disaggregation.kv_transfer=nccl"],
     "serve.llm.disaggregation.kv_transfer", "run on CPU"),
    ([SPLIT, "serve.llm.resources.num_replicas=2"], "serve.llm.resources.num_replicas",
     "replicas per role"),
    ([SPLIT, "+serve.llm.disaggregation.decode.host=10.0.0.2"],
     "serve.llm.disaggregation.decode.host", "experiment.runner.hostfile"),
    ([SPLIT, "experiment.runner.deploy.ingress=engine"], "experiment.runner.deploy.ingress",
     "carries each request"),
    ([SPLIT, "serve.llm.engine_args.tensor_parallel_size=2"],
     "serve.llm.engine_args.tensor_parallel_size", "TP = PP = 1"),
    (["+serve.llm.engine_args.kv_transfer={role: decode}"], "serve.llm.engine_args.kv_transfer",
     "set by the serving graph"),
    (["+serve.llm.disaggregation.decode.min_replicas=1"],
     "serve.llm.disaggregation.decode.max_replicas", "needs both"),
    (["+serve.llm.disaggregation.prefill.min_replicas=0",
      "+serve.llm.disaggregation.prefill.max_replicas=2"],
     "serve.llm.disaggregation.prefill.min_replicas", "stalls every request"),
    (["+serve.llm.disaggregation.prefill.target_running_requests=8"],
     "serve.llm.disaggregation.prefill.target_running_requests", "queued prompt tokens"),
    (["+serve.llm.disaggregation.decode.target_running_requests=8"],
     "serve.llm.disaggregation.decode.target_running_requests", "not autoscaled"),
])
def test_bad_disaggregation(capsys, overrides, key, words):
    code, out, err = run(capsys, *overrides)
    assert code == EXIT_CONFIG, out
    assert f"`{key}`" in err and words in err and "fix:" in err, err
    assert "Traceback" not in err


def flagscale(deploy: dict, serve: dict | None = None):
    serve = serve or {"llm": {"engine": "vllm", "engine_args": {"model": "/m"}}}
    return parse_config({"experiment": {"runner": {"deploy": deploy}}, "serve": serve})


def test_flagscale_keys_map_onto_the_module():
    config, notes = flagscale({"prefill_decode_disaggregation": True, "prefill_num": 1,
                               "decode_num": 2, "prefill_decode_strategy": "robin",
                               "prefill_address": "auto", "decode_address": "10.0.0.2",
                               "pd_proxy_port": 9000, "port": 9010})
    split = config.serve["llm"].disaggregation
    assert (split.prefill.num_replicas, split.decode.num_replicas) == (1, 2)
    assert (split.prefill.host, split.decode.host) == (None, "10.0.0.2")
    assert config.serve["llm"].router.strategy == "least_loaded"
    assert config.deploy.port == 9010  # the other deploy keys are untouched
    assert any("decode_num=2 -> serve.llm.disaggregation.decode.num_replicas" in n for n in notes)
    assert any("prefill_decode_strategy=robin -> serve.llm.router.strategy=least_loaded" in n
               for n in notes)
    assert any("dropping pd_proxy_port" in n for n in notes)
    config, notes = flagscale({"prefill_decode_disaggregation": False, "prefill_num": 2})
    assert config.serve["llm"].disaggregation is None
    assert any("ignoring prefill_num" in n for n in notes)


@pytest.mark.parametrize("deploy,key,words", [
    ({"prefill_decode_disaggregation": True, "prefill_num": 0}, "prefill_num", ">= 1"),
    ({"prefill_decode_disaggregation": "yes"}, "prefill_decode_disaggregation", "true/false"),
    ({"prefill_decode_disaggregation": True, "prefill_decode_strategy": "fastest"},
     "prefill_decode_strategy", "slo, robin, random"),
])
def test_flagscale_bad_keys(deploy, key, words):
    with pytest.raises(ConfigError) as err:
        flagscale(deploy)
    assert err.value.key == f"experiment.runner.deploy.{key}" and words in str(err.value)


def test_flagscale_split_needs_one_model():
    two = {"a": {"engine_args": {"model": "/a"}}, "b": {"engine_args": {"model": "/b"}}}
    with pytest.raises(ConfigError, match="2 LLM modules"):
        flagscale({"prefill_decode_disaggregation": True}, two)


def test_autoscaled_roles_scale_on_their_own_load():
    """Each role's Serve options, through Serve's own config and policy wrapper: decode on the
    requests its engines hold, prefill on queued prompt tokens, bounded by min/max."""
    from ray.serve._private.autoscaling_state import (
        _apply_autoscaling_config,
        _resolve_policy_callable,
    )
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from flagserve.config.hostfile import Host
    from flagserve.config.topology import role_module, role_scaling
    from flagserve.engine.stats import EngineStats
    from flagserve.serve.app import engine_options
    from flagserve.serve.autoscaling import load_report

    config, _ = parse_config({"serve": {"llm": {
        "engine_args": {"model": "/m", "max_num_seqs": 8, "max_num_batched_tokens": 512},
        "disaggregation": {"prefill": {"min_replicas": 1, "max_replicas": 3},
                           "decode": {"min_replicas": 1, "max_replicas": 4,
                                      "engine_args": {"max_num_seqs": 16}}}}}})
    module, hosts = config.serve["llm"], [Host("127.0.0.1", 2, "cpu")]

    def decide(role, reported: dict, current: int) -> int:
        options = engine_options(role_module(module, role), hosts, 7, role_scaling(module, role, hosts))
        assert "num_replicas" not in options
        scaling = AutoscalingConfig(**options["autoscaling_config"], upscale_delay_s=0,
                                    downscale_delay_s=0)
        assert (scaling.min_replicas, scaling.max_replicas) == {"prefill": (1, 3),
                                                                "decode": (1, 4)}[role]
        policy = _apply_autoscaling_config(_resolve_policy_callable(scaling.policy))
        replicas = [f"r{i}" for i in range(current)]
        metrics = {name: dict(zip(replicas, values)) for name, values in reported.items()}
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name=role, app_name="app", current_num_replicas=current,
            target_num_replicas=current, running_replicas=replicas, total_num_requests=0,
            total_queued_requests=0, aggregated_metrics=metrics, raw_metrics={},
            capacity_adjusted_min_replicas=scaling.min_replicas,
            capacity_adjusted_max_replicas=scaling.max_replicas, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=scaling)
        return min(max(policy(ctx)[0], scaling.min_replicas), scaling.max_replicas)

    # prefill: 2 x 512 queued tokens per replica; many requests held open is not load
    assert decide("prefill", {"queued_prompt_tokens": [2500], "running_requests": [0]}, 1) == 3
    assert decide("prefill", {"queued_prompt_tokens": [0, 0], "running_requests": [99, 99]}, 2) == 1
    # decode: 16 (its own max_num_seqs) requests per replica; a queue of prompts is not its load
    assert decide("decode", {"running_requests": [30, 20], "queued_prompt_tokens": [0, 0]}, 2) == 4
    assert decide("decode", {"running_requests": [3, 2], "queued_prompt_tokens": [9999] * 2}, 2) == 1
    assert decide("decode", {}, 2) == 2  # nothing reported yet: stay
    stats = EngineStats(3, 2, 0.5, 0, 0, 0, 0, 0, 0, 0.0, 0.0, queued_prompt_tokens=70)
    assert load_report(stats) == {"running_requests": 5, "queued_prompt_tokens": 70}
    assert role_scaling(dataclasses.replace(module, disaggregation=dataclasses.replace(
        module.disaggregation, decode=dataclasses.replace(module.disaggregation.decode,
                                                          min_replicas=None, max_replicas=None))),
        "decode", hosts) is None
