"""The routing strategies of serve.<id>.router alone (no Ray): prefix hashes, the prefix
table, and which replica each strategy picks from given loads."""
from __future__ import annotations

import asyncio
import re
from collections import Counter

from flagserve.config.schema import RouterConfig
from flagserve.engine.block_manager import chain_hash
from flagserve.serve.metrics_hub import MetricsHub
from flagserve.serve.metrics_router import RouterCounts
from flagserve.serve.routing.prefix import PrefixTable, prefix_hashes
from flagserve.serve.routing.strategy import (
    LeastLoaded,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    make_strategy,
)

SYSTEM = list(range(100, 164))  # 4 blocks of 16 tokens
OTHER = list(range(500, 564))


def hashes(tokens: list[int], max_blocks: int = 8) -> list[int]:
    return prefix_hashes(tokens, block_size=16, max_blocks=max_blocks)


def idle(*names: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(n) for n in names]


def test_prefix_hashes_are_the_engines_chained_block_hashes():
    h = hashes(SYSTEM + [1, 2, 3])
    assert len(h) == 4  # the partial fifth block is not hashed
    assert h[0] == chain_hash(0, tuple(SYSTEM[:16]))
    assert h[1] == chain_hash(h[0], tuple(SYSTEM[16:32]))
    assert hashes(SYSTEM + [9] * 16)[:4] == h  # a shared prefix shares its leading hashes
    assert hashes(OTHER)[0] != h[0]
    assert hashes(SYSTEM, max_blocks=2) == h[:2]
    assert hashes(SYSTEM[:15]) == []


def test_prefix_table_depth_eviction_and_forget():
    table = PrefixTable(capacity=6)
    table.insert(hashes(SYSTEM[:32]), "a")  # blocks 0-1
    table.insert(hashes(SYSTEM), "b")  # blocks 0-3
    assert table.depths(hashes(SYSTEM + OTHER)) == {"a": 2, "b": 4}
    assert table.depths(hashes(OTHER)) == {}
    table.insert(hashes(OTHER[:48]), "a")  # 3 more hashes: the oldest (SYSTEM's block 0) goes
    assert len(table) == 6
    assert table.depths(hashes(SYSTEM)) == {"a": 2, "b": 4}  # blocks 1-3 still there
    table.forget("b")
    assert table.depths(hashes(SYSTEM)) == {"a": 2}
    assert len(table) == 4


def test_round_robin_cycles_whatever_the_load():
    rr = RoundRobin()
    loads = [ReplicaLoad("a", 50), ReplicaLoad("b", 0), ReplicaLoad("c", 7)]
    picks = [rr.choose(loads, hashes(SYSTEM)).replica for _ in range(6)]
    assert Counter(picks) == {"a": 2, "b": 2, "c": 2}
    assert picks[:3] == picks[3:] and len(set(picks[:3])) == 3
    assert rr.choose(loads, []).outcome == "round_robin"


def test_least_loaded_counts_requests_and_kv_usage_and_rotates_ties():
    ll = LeastLoaded(kv_usage_weight=8.0)
    assert ll.choose([ReplicaLoad("a", 3), ReplicaLoad("b", 1)], []).replica == "b"
    # 1 request + a full KV cache (8) is more load than 3 requests and an empty one
    assert ll.choose([ReplicaLoad("a", 3), ReplicaLoad("b", 1, kv_usage=1.0)], []).replica == "a"
    picks = {ll.choose(idle("a", "b"), hashes(SYSTEM)).replica for _ in range(4)}
    assert picks == {"a", "b"}  # equal loads: in turn, prefix or not
    ll.routed("a", hashes(SYSTEM))
    assert ll.choose([ReplicaLoad("a", 1), ReplicaLoad("b", 0)], hashes(SYSTEM)).replica == "b"


def test_prefix_aware_affinity_wins_when_loads_are_close():
    pa = PrefixAware(max_imbalance=8.0, kv_usage_weight=8.0)
    pa.routed("b", hashes(SYSTEM))
    loads = [ReplicaLoad("a", 0), ReplicaLoad("b", 5), ReplicaLoad("c", 1)]
    decision = pa.choose(loads, hashes(SYSTEM + OTHER))
    assert (decision.replica, decision.outcome, decision.matched_blocks) == ("b", "affinity", 4)
    # the deepest match wins among holders
    pa.routed("c", hashes(SYSTEM[:16]))
    assert pa.choose(loads, hashes(SYSTEM)).replica == "b"
    assert pa.choose(loads, hashes(SYSTEM[:16])).replica == "c"  # equal depth: the lighter


def test_prefix_aware_load_wins_when_the_holder_is_overloaded():
    pa = PrefixAware(max_imbalance=8.0, kv_usage_weight=8.0)
    pa.routed("b", hashes(SYSTEM))
    decision = pa.choose([ReplicaLoad("a", 0), ReplicaLoad("b", 9)], hashes(SYSTEM))
    assert (decision.replica, decision.outcome) == ("a", "overload")
    assert pa.choose([ReplicaLoad("a", 0), ReplicaLoad("b", 8)], hashes(SYSTEM)).replica == "b"
    # a nearly full KV cache is load too
    full = [ReplicaLoad("a", 0), ReplicaLoad("b", 2, kv_usage=0.9)]
    assert pa.choose(full, hashes(SYSTEM)).outcome == "overload"
    pa.routed("a", hashes(SYSTEM))  # now both hold it: the lighter of the two
    assert pa.choose([ReplicaLoad("a", 4), ReplicaLoad("b", 2)], hashes(SYSTEM)).replica == "b"


def test_prefix_aware_new_prefixes_balance_and_agree_across_routers():
    first, second = PrefixAware(8.0, 8.0), PrefixAware(8.0, 8.0)
    replicas = idle("a", "b", "c", "d")
    homes = {}
    for i in range(12):
        prompt = hashes([i] * 64)
        one, two = first.choose(replicas, prompt), second.choose(replicas, prompt)
        assert one.outcome == "balance" and one.replica == two.replica  # no shared state needed
        homes[i] = one.replica
    assert len(set(homes.values())) > 1  # new prefixes spread over the replicas
    # a new prefix goes to the least loaded replica, whatever its hash says
    busy = [ReplicaLoad(n, 0 if n == "c" else 1) for n in "abcd"]
    assert {first.choose(busy, hashes([i] * 64)).replica for i in range(12)} == {"c"}
    # distinct prompts under one shared first block (a chat template's header) spread out
    header = [1] * 16
    assert len({first.choose(replicas, hashes(header + [i] * 48)).replica for i in range(12)}) > 1
    # a prompt under one block has no prefix: equal loads in turn
    assert {first.choose(idle("a", "b"), []).replica for _ in range(4)} == {"a", "b"}


def test_make_strategy_from_config():
    assert isinstance(make_strategy(RouterConfig()), PrefixAware)
    assert make_strategy(RouterConfig(strategy="least_loaded", kv_usage_weight=2.0)).kv_usage_weight == 2.0
    assert make_strategy(RouterConfig(strategy="round_robin")).name == "round_robin"
    assert make_strategy(RouterConfig(max_imbalance=3.0)).max_imbalance == 3.0


def test_router_decisions_on_metrics_summed_over_routers():
    hub = MetricsHub()
    for key, outcomes in ((("tiny", "r1"), ["affinity", "affinity", "balance"]),
                          (("tiny", "r2"), ["affinity"])):
        counts = RouterCounts("tiny", "prefix_aware")
        for outcome in outcomes:
            counts.add("e0", outcome)
        asyncio.run(hub.push_router(key, counts.snapshot()))
    text = asyncio.run(hub.render()).decode()
    found = {m[0]: float(m[1]) for m in re.findall(
        r'flagserve:router_decisions_total\{engine="e0",model_name="tiny",outcome="(\w+)",'
        r'strategy="prefix_aware"\} (\S+)', text)}
    assert found == {"affinity": 3.0, "balance": 1.0}
    assert "vllm:num_requests_running" in text  # the engines' families are still rendered
