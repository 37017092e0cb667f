"""The strategies of serve.<id>.router: given each replica's load and the prompt's prefix
hashes, which replica gets the request. Free of Ray: ray_router.py feeds them from Ray
Serve, the unit tests feed them directly.

    round_robin   replicas in turn, whatever their load
    least_loaded  the lowest load; equal loads in turn
    prefix_aware  the replica that was sent the longest run of the prompt's leading blocks
                  (its prefix cache likely holds them), unless its load exceeds the lowest
                  by more than max_imbalance; else (a new prefix, or its holders too busy)
                  as least_loaded, equal loads broken by rendezvous hashing of the prefix
                  so that idle routers agree

load = ongoing requests (running + waiting) + kv_usage_weight x KV cache usage (0..1): a
full cache preempts and queues, so it counts as that many requests more.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import xxhash

from flagserve.config.schema import RouterConfig
from flagserve.serve.routing.prefix import PrefixTable

# affinity: the replica holding the prefix; overload: it was too busy, the least loaded got
# it; balance: nobody holds it (or the prompt is under one block), the least loaded got it;
# fallback (counted by the Serve adapter): the chosen replica was full and refused.
Outcome = Literal["affinity", "overload", "balance", "least_loaded", "round_robin", "fallback"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica: str
    ongoing: int = 0  # requests in the replica: running and waiting
    kv_usage: float = 0.0  # share of its KV cache in use, 0..1


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    outcome: Outcome
    matched_blocks: int = 0  # leading blocks of the prompt the chosen replica was sent before


def load(r: ReplicaLoad, kv_usage_weight: float) -> float:
    return r.ongoing + kv_usage_weight * r.kv_usage


class Strategy(Protocol):
    name: str

    def choose(self, replicas: Sequence[ReplicaLoad], prefix: Sequence[int]) -> Decision: ...

    def routed(self, replica: str, prefix: Sequence[int]) -> None: ...

    def forget(self, replica: str) -> None: ...


class _Rotation:
    """Picks among equals in turn, so idle replicas share one-at-a-time traffic."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, replicas: Sequence[str]) -> str:
        ordered = sorted(replicas)  # an order that survives replicas coming and going
        self._turn += 1
        return ordered[self._turn % len(ordered)]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, replicas: Sequence[ReplicaLoad], prefix: Sequence[int]) -> Decision:
        return Decision(self._rotation.pick([r.replica for r in replicas]), "round_robin")

    def routed(self, replica: str, prefix: Sequence[int]) -> None:
        """Round robin remembers nothing about requests."""

    def forget(self, replica: str) -> None:
        """Nor about replicas."""


class LeastLoaded(RoundRobin):
    name = "least_loaded"

    def __init__(self, kv_usage_weight: float) -> None:
        super().__init__()
        self.kv_usage_weight = kv_usage_weight

    def load(self, r: ReplicaLoad) -> float:
        return load(r, self.kv_usage_weight)

    def lightest(self, replicas: Sequence[ReplicaLoad], tie: Callable[[list[str]], str]) -> str:
        low = min(self.load(r) for r in replicas)
        return tie([r.replica for r in replicas if self.load(r) == low])

    def choose(self, replicas: Sequence[ReplicaLoad], prefix: Sequence[int]) -> Decision:
        return Decision(self.lightest(replicas, self._rotation.pick), "least_loaded")


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def __init__(self, max_imbalance: float, kv_usage_weight: float,
                 table: PrefixTable | None = None) -> None:
        super().__init__(kv_usage_weight)
        self.max_imbalance = max_imbalance
        self.table = table if table is not None else PrefixTable()

    def choose(self, replicas: Sequence[ReplicaLoad], prefix: Sequence[int]) -> Decision:
        depths = self.table.depths(prefix)
        low = min(self.load(r) for r in replicas)
        holders = [r for r in replicas if depths.get(r.replica)]
        fit = [r for r in holders if self.load(r) - low <= self.max_imbalance]
        if fit:
            best = max(fit, key=lambda r: (depths[r.replica], -self.load(r)))
            return Decision(best.replica, "affinity", depths[best.replica])
        # Equal loads and a prefix: the replica its deepest hash ranks first (not the first
        # block's: a chat template's header is everyone's), the same in every router.
        tie = (lambda names: rendezvous(prefix[-1], names)) if prefix else self._rotation.pick
        return Decision(self.lightest(replicas, tie), "overload" if holders else "balance")

    def routed(self, replica: str, prefix: Sequence[int]) -> None:
        self.table.insert(prefix, replica)

    def forget(self, replica: str) -> None:
        self.table.forget(replica)


def rendezvous(key: int, replicas: Sequence[str]) -> str:
    """The replica with the highest hash of (key, replica): every router that sees the same
    replicas sends a new prefix to the same one, without sharing any state."""
    return max(replicas, key=lambda r: xxhash.xxh64_intdigest(f"{key}:{r}".encode()))


def make_strategy(config: RouterConfig) -> Strategy:
    if config.strategy == "round_robin":
        return RoundRobin()
    if config.strategy == "least_loaded":
        return LeastLoaded(config.kv_usage_weight)
    return PrefixAware(config.max_imbalance, config.kv_usage_weight)
