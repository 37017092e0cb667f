"""Settings read from the environment, each checked against its mode's choices."""
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

Switch = Literal["on", "off"]  # a setting that is on or off
CACHE_ENV = "FLAGSERVE_CACHE"


def cache_root() -> Path:
    """Where FlagServe keeps what it builds once and reuses (tiny models, GGUF tokenizers, CPU
    kernels, inductor's code): $FLAGSERVE_CACHE, else ~/.cache/flagserve."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flagserve")


# The CPU engine's settings read from the environment, each with its choices: read where they
# apply (README, CPU), and all checked by `action=plan` when experiment.envs sets them.
KERNELS_ENV = "FLAGSERVE_CPU_KERNELS"
CpuKernels = Literal["auto", "native", "torch"]
MATMUL_ENV = "FLAGSERVE_CPU_MATMUL"
CpuMatmul = Literal["auto", "aten", "native", "onednn"]
WEIGHTS_ENV = "FLAGSERVE_CPU_WEIGHTS"
CpuWeights = Literal["auto", "float32"]
COMPILE_ENV = "FLAGSERVE_CPU_COMPILE"
CpuCompile = Literal["off", "ops"]
GREEDY_HEAD_ENV = "FLAGSERVE_CPU_GREEDY_HEAD"
Approximation = Literal["bf16", "int8"]
GreedyHeadMode = Literal["auto", Approximation, "off"]
NATIVE_LAYERS_ENV = "FLAGSERVE_CPU_NATIVE_LAYERS"
TUNING_ENV = "FLAGSERVE_CPU_THREAD_TUNING"
PRELOAD_ENV = "FLAGSERVE_CPU_PRELOAD"
Preload = Literal["on", "off", "1", "0"]
SETTINGS: dict[str, Any] = {
    KERNELS_ENV: CpuKernels, MATMUL_ENV: CpuMatmul, WEIGHTS_ENV: CpuWeights,
    COMPILE_ENV: CpuCompile, GREEDY_HEAD_ENV: GreedyHeadMode, NATIVE_LAYERS_ENV: Switch,
    TUNING_ENV: Switch, PRELOAD_ENV: Preload}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def env_choice(name: str, mode: Any, default: str, requested: str | None = None,
               environ: Mapping[str, str] | None = None) -> Any:
    """`requested`, else the environment's `name`, else `default`: one of the `Literal` mode's
    values, or a ValueError naming the variable and its choices."""
    value = requested
    if value is None:
        value = (os.environ if environ is None else environ).get(name, default)
    if value not in get_args(mode):
        raise ValueError(f"{name} must be one of {get_args(mode)}, got {value!r}")
    return value
