"""Checks of experiment.bench (action=bench), each failure one ConfigError naming the key."""
from __future__ import annotations

import math
from pathlib import Path

from flagserve.config.errors import ConfigError
from flagserve.config.schema import BenchConfig, Config, LLMModule

KEY = "experiment.bench"


def prepare_bench(config: Config, base: Path) -> None:
    """Make experiment.bench's paths absolute (relative to `base`) and validate it."""
    bench = config.experiment.bench
    for name in ("dataset_path", "result_dir"):
        value = getattr(bench, name)
        if value:
            path = Path(value).expanduser()
            setattr(bench, name, str(path if path.is_absolute() else (base / path).resolve()))
    validate_bench(config)


def validate_bench(config: Config) -> None:
    b = config.experiment.bench
    check_workload(b)
    if b.module is not None and not isinstance(config.serve.get(b.module), LLMModule):
        llms = ", ".join(config.llms) or "(none)"
        raise ConfigError(f"{KEY}.module", f"{b.module!r} is not an LLM module of serve",
                          f"use one of: {llms}, or null for the first")
    if b.compare_base_url is not None and not b.compare_base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{KEY}.compare_base_url", f"{b.compare_base_url!r} is not an http(s) URL",
                          "e.g. http://127.0.0.1:8001")


def check_workload(b: BenchConfig) -> None:
    """The workload's own fields (benchmarks/serve.py's options too): a ConfigError naming one."""
    if b.dataset == "jsonl":
        if not b.dataset_path:
            raise ConfigError(f"{KEY}.dataset_path", "is not set (the jsonl dataset reads it)",
                              f"set {KEY}.dataset_path=prompts.jsonl, one {{\"prompt\": ...}} per line")
        if not Path(b.dataset_path).is_file():
            raise ConfigError(f"{KEY}.dataset_path", f"file {b.dataset_path!r} does not exist",
                              "point it at a JSONL file of prompts")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(b, name) < 1:
            raise ConfigError(f"{KEY}.{name}", f"must be >= 1, got {getattr(b, name)}", "e.g. 128")
    if b.dataset == "shared-prefix" and b.prefix_len < 1:
        raise ConfigError(f"{KEY}.prefix_len", f"must be >= 1, got {b.prefix_len}", "e.g. 512")
    if b.num_prefixes < 1:
        raise ConfigError(f"{KEY}.num_prefixes", f"must be >= 1, got {b.num_prefixes}",
                          "e.g. 8 (prompts then share one of 8 prefixes)")
    if not 0 <= b.range_ratio < 1:
        raise ConfigError(f"{KEY}.range_ratio", f"must be in [0, 1), got {b.range_ratio}", "e.g. 0.5")
    if math.isnan(b.request_rate) or b.request_rate <= 0:
        raise ConfigError(f"{KEY}.request_rate", f"must be > 0, got {b.request_rate}",
                          f"requests per second, e.g. {KEY}.request_rate=10, or inf for all at once")
    if b.burstiness <= 0:
        raise ConfigError(f"{KEY}.burstiness", f"must be > 0, got {b.burstiness}", "1.0 is Poisson")
    if b.max_concurrency is not None and b.max_concurrency < 1:
        raise ConfigError(f"{KEY}.max_concurrency", f"must be >= 1 or null, got {b.max_concurrency}",
                          "e.g. 32, or null for no limit")
    if b.repeats < 1:
        raise ConfigError(f"{KEY}.repeats", f"must be >= 1, got {b.repeats}", "e.g. 3")
    if b.warmup < 0:
        raise ConfigError(f"{KEY}.warmup", f"must be >= 0, got {b.warmup}", "e.g. 2")
