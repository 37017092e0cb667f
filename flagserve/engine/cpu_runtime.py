"""CPU threads of an engine: how many, on which cores, and the runtime libraries (issue 16).

    replica     Ray reserves `num_cpus` for it and sets OMP_NUM_THREADS to that count; it
                hosts the HTTP server and the tokenizer, so it keeps one torch thread and a
                serial tokenizer
    engine      the child process (engine/core/process.py) runs the model with one torch
                thread per owned core, each OpenMP thread bound to its own core

Why bind: an unbound OpenMP team migrates between cores and loses its caches each time a
neighbour (the replica's event loop, the tokenizer) wakes. Binding is only done when the
engine owns every core it may run on; with fewer (several replicas on one host) two
engines would be bound to the same cores, so only the thread count is set.

`FLAGSERVE_CPU_BIND` overrides the choice, like vLLM's VLLM_CPU_OMP_THREADS_BIND: `auto`
(the rule above), `off` (count only), or a core list such as `0-1` or `0,2,4`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kernels.env import PRELOAD_ENV, Preload, env_choice

BIND_ENV = "FLAGSERVE_CPU_BIND"
# How OpenMP threads wait at a barrier (one per op). GNU OpenMP spins ~300k iterations
# (milliseconds) by default: when another process takes one of the team's cores, the spinning
# thread waits out a scheduler time slice for its descheduled partner, op after op. A passive wait
# never collapses, but pays a wake-up per op, a large share of a small decode step. A short spin
# (3000 iterations, tens of us: longer than the gap between a step's ops, far shorter than a time
# slice) keeps the team awake through a step and sleeps between steps; where a neighbour does take
# a core, the thread tuner (cpu_threads.py) falls back to one thread. Measured:
# docs/performance.md, CPU. The user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
SPIN_COUNT = "3000"


@dataclass(frozen=True)
class ThreadPlan:
    num_threads: int
    cpus: tuple[int, ...]  # the cores the threads are bound to, one each; () = unbound

    def env(self, current: Mapping[str, str] | None = None) -> dict[str, str]:
        """What the engine process must start with: OpenMP reads it once, at load. A wait
        policy already in `current` (the user's) is kept."""
        env = {"OMP_NUM_THREADS": str(self.num_threads), "MKL_NUM_THREADS": str(self.num_threads)}
        current = current or {}
        if self.num_threads > 1 and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(current):
            env["GOMP_SPINCOUNT"] = SPIN_COUNT  # why: the comment on SPIN_COUNT
        if self.cpus:
            env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in self.cpus)
            env["OMP_PROC_BIND"] = "close"
        return env


CORE_RANGE = re.compile(r"([0-9]{1,4})(?:-([0-9]{1,4}))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6); ValueError naming the variable on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        match = CORE_RANGE.fullmatch(part.strip())
        lo, hi = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, -1)
        if hi < lo:
            raise ValueError(f"{BIND_ENV} must be auto, off or cores such as 0-3,6; got {text!r}")
        cpus.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(cpus))


def plan_threads(allowed: Sequence[int], owned: int | None, bind: str = "auto") -> ThreadPlan:
    """The engine's threads, from the cores this process may run on (`allowed`), the cores
    its replica owns (`owned`: Ray's num_cpus, None = all allowed) and FLAGSERVE_CPU_BIND."""
    allowed, bind = tuple(sorted(allowed)), bind or "auto"  # set but empty: as unset
    if bind not in ("auto", "off"):
        cpus = parse_cpu_list(bind)
        outside = [c for c in cpus if c not in allowed]
        if outside:  # a thread per named core: more threads than cores, bound to none
            raise ValueError(f"{BIND_ENV}={bind} names cores {outside[:8]} that this process "
                             f"may not run on; its cores: {','.join(map(str, allowed))}")
        return ThreadPlan(len(cpus), cpus)
    n = max(1, min(owned or len(allowed), len(allowed)))
    bound = bind == "auto" and n == len(allowed)
    return ThreadPlan(n, allowed if bound else ())


def owned_cpus(env: Mapping[str, str]) -> int | None:
    """The replica's reservation as Ray passes it on (OMP_NUM_THREADS in a Ray worker, or
    set by the user); None when unset."""
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def engine_thread_plan(env: Mapping[str, str] | None = None) -> ThreadPlan:
    env = os.environ if env is None else env
    return plan_threads(sorted(os.sched_getaffinity(0)), owned_cpus(env), env.get(BIND_ENV, "auto"))


def apply_thread_plan(plan: ThreadPlan) -> None:
    """In the engine process, before the model loads (the env part was set at spawn)."""
    import torch

    if plan.cpus:
        os.sched_setaffinity(0, plan.cpus)
    torch.set_num_threads(plan.num_threads)


def serial_tokenizers() -> None:
    """HF tokenizers without their thread pool, here and in the processes started from now on
    (a replica's engine process): none competes with the engine's bound threads."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_host_process() -> None:
    """The replica whose engine runs in a child: one torch thread, so that it does not compete
    with the engine's bound threads for its cores (serial_tokenizers for the tokenizer)."""
    import torch

    torch.set_num_threads(1)


def replica_cpus(host_cpus: int, engine_replicas: int) -> float:
    """Default Ray num_cpus of a CPU engine replica: its share of the host's cores (the
    other deployments of the graph reserve none). Whole cores while there are enough; a
    fraction when there are more replicas than cores (2P2D on 2 cores), else some replicas
    would wait forever to be scheduled."""
    engine_replicas = max(1, engine_replicas)
    if engine_replicas > host_cpus:
        return host_cpus / engine_replicas
    return host_cpus // engine_replicas


# tcmalloc (vLLM's CPU guide recommends it with Intel OpenMP): LD_PRELOAD works only for a
# process that starts with it, so the engine process gets it at spawn (core/process.py) and
# compare_vllm's FlagServe worker gets it in its environment. Missing, it is skipped silently;
# FLAGSERVE_CPU_PRELOAD=off (or 0) turns it off. Intel OpenMP is not preloaded for FlagServe:
# on top of tcmalloc it measured 3-17% slower than torch's own GNU OpenMP (docs/performance.md,
# CPU).
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def tcmalloc_library(search: Sequence[str] = TCMALLOC_DIRS) -> list[str]:
    """[path] of the tcmalloc found in `search`, or []."""
    for name in TCMALLOC_NAMES:
        for directory in search:
            if os.path.exists(path := os.path.join(directory, name)):
                return [path]
    return []


def intel_openmp_library(prefix: str) -> list[str]:
    """[path] of Intel OpenMP (PyPI intel-openmp) in the venv at `prefix`, or []."""
    path = os.path.join(prefix, "lib", "libiomp5.so")
    return [path] if os.path.exists(path) else []


def preload_env(env: Mapping[str, str], libraries: Sequence[str]) -> dict[str, str]:
    """LD_PRELOAD with `libraries` in front of what `env` has (none twice); {} when turned
    off or nothing is found."""
    if env_choice(PRELOAD_ENV, Preload, "on", environ=env) in ("off", "0") or not libraries:
        return {}
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    wanted = [lib for lib in libraries if lib not in current]
    if not wanted:
        return {}
    return {"LD_PRELOAD": ":".join([*wanted, *current])}


# Transparent huge pages for torch's allocations of 2 MB and more (the KV cache, the packed
# weights): torch madvises them when THP_MEM_ALLOC_ENABLE is set as the process starts. With 4 KB
# pages a decode step's walk over scattered cache blocks and ~0.5 GB of weights misses the TLB
# page after page; decode attention and small-batch linears run faster with huge pages
# (docs/performance.md, CPU).
# The user's value wins (0 turns it off); a kernel with THP `never` ignores the advice.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def huge_pages_env(env: Mapping[str, str]) -> dict[str, str]:
    return {} if THP_ENV in env else {THP_ENV: "1"}


def cpu_process_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a CPU engine process started with `env` adds to it: tcmalloc and huge pages."""
    return {**preload_env(env, tcmalloc_library()), **huge_pages_env(env)}


def runtime_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a CPU process started with `env` lacks of the engine's thread plan, tcmalloc and
    huge pages."""
    wanted = {**engine_thread_plan(env).env(env), **cpu_process_env(env)}
    return {k: v for k, v in wanted.items() if env.get(k) != v}
