"""Prefix caching shares blocks, counts its hits, and never changes outputs."""
from flagserve import LLM, SamplingParams
from flagserve.engine import block_manager as bm_module
from flagserve.engine.block_manager import BlockManager
from flagserve.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SYSTEM = ("You are a careful assistant who answers questions about cooking, weather and old "
          "computers in short plain sentences, and always counts to ten before answering. ")
QUESTIONS = ["How do I cook rice?", "Will it rain today?", "What is a floppy disk?",
             "Count the beans.", "Why is the river calm?", "Name a spice."]


def run(path: str, caching: bool, **kw):
    llm = LLM(path, dtype="float32", enable_prefix_caching=caching, **kw)
    outs = llm.generate([SYSTEM + q for q in QUESTIONS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats(), outs


def test_caching_on_and_off_identical_with_hits(llama_path):
    off, off_stats, _ = run(llama_path, False)
    on, on_stats, outs = run(llama_path, True)
    assert on == off
    assert off_stats.prefix_cache_hits == 0
    assert on_stats.prefix_cache_hits > 0
    assert on_stats.prefix_cache_hits % 16 == 0  # whole blocks only
    assert on_stats.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outs)
    # Every request after the first found the shared system prompt's full blocks.
    # (The last system-prompt token may merge with the question's first one.)
    shared_blocks = (len(LLM(llama_path).get_tokenizer().encode(SYSTEM)) - 1) // 16
    assert shared_blocks >= 2
    assert all(o.num_cached_tokens >= shared_blocks * 16 for o in outs[1:])


def test_later_request_reuses_freed_blocks(llama_path):
    llm = LLM(llama_path, dtype="float32")
    first = llm.generate(SYSTEM + QUESTIONS[0], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate(SYSTEM + QUESTIONS[0], GREEDY, use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 16 * 16  # all but the token left to compute
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_hash_collisions_never_share_wrong_blocks(llama_path, monkeypatch):
    expected, _, _ = run(llama_path, False)
    monkeypatch.setattr(bm_module, "chain_hash", lambda *_: 42)  # everything collides
    got, stats, _ = run(llama_path, True)
    assert got == expected


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, list(tokens), len(tokens), SamplingParams(), 0.0)


def test_block_manager_refcounts_and_eviction():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a, b = make_seq(list(range(10))), make_seq(list(range(8)) + [99, 98, 97])
    for seq in (a, b):
        hits = bm.match_prefix(seq)
        assert bm.can_admit(hits, seq.num_tokens - len(hits) * 4)
        bm.admit(seq, hits)
        assert bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_free_blocks == 6 - 4
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 6
    # Freed blocks keep their contents: the prefix is still found.
    c = make_seq(list(range(9)))
    assert len(bm.match_prefix(c)) == 2
    # Once every block has been reallocated the old prefix is gone.
    d = make_seq(list(range(100, 124)))
    bm.admit(d, [])
    assert bm.append_slots(d, 24)
    assert bm.match_prefix(c) == []
    assert bm.usage() == 1.0


def test_prefix_cache_off_counts_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(9)))
    bm.admit(seq, bm.match_prefix(seq))
    assert bm.append_slots(seq, 9)
    bm.free_sequence(seq)
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0
