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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BIND_ENV = "FLAGSERVE_CPU_BIND"


@dataclass(frozen=True)
class ThreadPlan:
    num_threads: int
    cpus: tuple[int, ...]  # the cores the threads are bound to, one each; () = unbound

    def env(self) -> dict[str, str]:
        """What the engine process must start with: OpenMP reads it once, at load."""
        env = {"OMP_NUM_THREADS": str(self.num_threads), "MKL_NUM_THREADS": str(self.num_threads)}
        if self.cpus:
            env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in self.cpus)
            env["OMP_PROC_BIND"] = "close"
        return env


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6); ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"{BIND_ENV}: bad core range {part!r}")
        cpus.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(cpus))


def plan_threads(allowed: Sequence[int], owned: int | None, bind: str = "auto") -> ThreadPlan:
    """The engine's threads, from the cores this process may run on (`allowed`), the cores
    its replica owns (`owned`: Ray's num_cpus, None = all allowed) and FLAGSERVE_CPU_BIND."""
    allowed = tuple(sorted(allowed))
    if bind not in ("auto", "off"):
        cpus = parse_cpu_list(bind)
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


def quiet_host_process() -> None:
    """The replica whose engine runs in a child: one torch thread and a serial tokenizer,
    so that neither competes with the engine's bound threads for its cores."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)


def replica_cpus(host_cpus: int, engine_replicas: int) -> int:
    """Default Ray num_cpus of a CPU engine replica: its share of the host's cores (the
    other deployments of the graph reserve none)."""
    return max(1, host_cpus // max(1, engine_replicas))
