"""The padded decode path (CUDA graphs' shapes, run eagerly on CPU) changes nothing a request gets."""
import numpy as np
import pytest
import torch

from flagserve import LLM, SamplingParams
from flagserve.engine import cuda_graphs
from flagserve.engine.input_buffers import StepBuffers, bucket_for, decode_buckets
from flagserve.engine.model_runner import ModelRunner
from flagserve.engine.step_input import StepInput
from tests.conftest import prompt_set


def test_buckets():
    assert decode_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert decode_buckets(256)[-1] == 256 and len(decode_buckets(256)) == 35
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(1) == [1]
    assert [bucket_for(n, decode_buckets(20)) for n in (1, 3, 9, 17, 20, 21)] == [1, 4, 16, 20, 20, None]


def step_of(num_new, starts, tables, samples):
    tokens = list(range(100, 100 + sum(num_new)))
    return StepInput(list(range(len(num_new))), num_new, starts, tables, tokens, samples,
                     [0] * len(samples), None)


def test_fill_exact_mixed_step():
    bufs = StepBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, block_size=4,
                       device=torch.device("cpu"))
    # Two decodes, then a prefill chunk of 5 from position 3 and a whole prompt of 2.
    step = step_of([1, 1, 5, 2], [6, 0, 3, 0], [[7, 2], [5], [1, 3, 4], [6]], [0, 1, 3])
    b = bufs.fill(step)
    assert not b.padded and b.num_rows == b.num_tokens == 9
    assert b.input_ids.tolist() == list(range(100, 109))
    assert b.positions.tolist() == [6, 0, 3, 4, 5, 6, 7, 0, 1]
    # slot = table[pos // 4] * 4 + pos % 4
    assert b.meta.slot_mapping.tolist() == [10, 20, 7, 12, 13, 14, 15, 24, 25]
    assert b.meta.num_decode_tokens == 2
    assert b.meta.seq_lens.tolist() == [7, 1, 8, 2]
    assert b.meta.cu_seqlens_q.tolist() == [0, 5, 7]
    assert b.meta.block_tables.tolist() == [[7, 2, 0], [5, 0, 0], [1, 3, 4], [6, 0, 0]]
    assert b.logits_indices.tolist() == [0, 1, 8]


def test_fill_decode_only_step_and_reuse_of_its_views():
    bufs = StepBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, block_size=4,
                       device=torch.device("cpu"))
    bufs.fill(step_of([1, 1, 5, 2], [6, 0, 3, 0], [[7, 2], [5], [1, 3, 4], [6]], [0, 1, 3]))
    # Decodes only (the fast path): a sampled subset, one not sampled (a chunk's last piece)
    b = bufs.fill(step_of([1, 1, 1], [4, 9, 1], [[2, 3], [1, 3, 4], [6]], [0, 2]))
    assert not b.padded and b.num_rows == b.num_tokens == 3 and b.meta.num_decode_tokens == 3
    assert b.positions.tolist() == [4, 9, 1] and b.input_ids.tolist() == [100, 101, 102]
    assert b.meta.slot_mapping.tolist() == [12, 17, 25]
    assert b.meta.seq_lens.tolist() == [5, 10, 2] and b.meta.cu_seqlens_q.tolist() == [0]
    assert b.logits_indices.tolist() == [0, 2]
    # The same sizes next step: the same views, holding the new step's values
    again = bufs.fill(step_of([1, 1, 1], [5, 10, 2], [[2, 3], [1, 3, 4], [6]], [0, 2]))
    assert again is b and b.positions.tolist() == [5, 10, 2]
    assert b.meta.slot_mapping.tolist() == [13, 18, 26]
    assert bufs.fill(step_of([1, 1, 1], [5, 10, 2], [[2, 3], [1, 3, 4], [6]], [1])) is not b


def test_decode_order_longest_first():
    # Where the decode kernel takes a launch order: the decodes by descending length, padded
    # rows (length 1) last; a prefill-only step has none, nor a kernel that takes none.
    bufs = StepBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, block_size=4,
                       device=torch.device("cpu"), order_decodes=True)
    b = bufs.fill(step_of([1, 1, 1, 5], [2, 9, 4, 0], [[7], [5, 1, 3], [6, 2], [4, 8]], [0, 1, 2, 3]))
    assert b.meta.seq_lens.tolist() == [3, 10, 5, 5] and b.meta.decode_order.tolist() == [1, 2, 0]
    b = bufs.fill(step_of([1, 1], [2, 9], [[7], [5, 1, 3]], [0, 1]), pad_to=4)
    assert b.meta.decode_order.tolist() == [1, 0, 2, 3]
    assert b.meta.decode_order.data_ptr() == bufs.padded_batch(4).meta.decode_order.data_ptr()
    assert bufs.fill(step_of([5], [0], [[4, 8]], [0])).meta.decode_order is None
    unordered = StepBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, block_size=4,
                            device=torch.device("cpu"))
    assert unordered.fill(step_of([1, 1], [2, 9], [[7], [5, 1, 3]], [0, 1])).meta.decode_order is None


def test_fill_padded_decode_step():
    bufs = StepBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=3, block_size=4,
                       device=torch.device("cpu"))
    bufs.fill(step_of([1, 1, 5, 2], [6, 0, 3, 0], [[7, 2], [5], [1, 3, 4], [6]], [0, 1, 3]))
    b = bufs.fill(step_of([1, 1, 1], [4, 9, 1], [[2, 3], [1, 3, 4], [6]], [0, 1, 2]), pad_to=4)
    assert b.padded and b.num_rows == 4 and b.num_tokens == 3
    assert b.meta.num_decode_tokens == 4  # the padded row is a decode too
    assert b.meta.slot_mapping.tolist() == [12, 17, 25, -1]  # -1: the KV store skips it
    assert b.positions.tolist() == [4, 9, 1, 0] and b.input_ids.tolist()[3] == 0
    assert b.meta.seq_lens.tolist() == [5, 10, 2, 1]
    assert b.meta.block_tables.tolist() == [[2, 3, 0], [1, 3, 4], [6, 0, 0], [0, 0, 0]]
    assert b.meta.cu_seqlens_q.tolist() == [0]
    assert b.logits_indices.tolist() == [0, 1, 2]
    # The same addresses every time: what a captured graph reads.
    assert b.meta.block_tables.data_ptr() == bufs.padded_batch(4).meta.block_tables.data_ptr()


def padded_rows(llm: LLM) -> list[tuple[int, int]]:
    """Make the engine pad decode steps (as with graphs) and record (rows, real tokens) of each."""
    runner: ModelRunner = llm.llm_engine.executor.runner
    runner.prepare_decode_paths("padded")
    seen = []
    prepare = runner.prepare

    def spy(step):
        batch = prepare(step)
        if batch.padded:
            seen.append((batch.num_rows, batch.num_tokens))
        return batch

    runner.prepare = spy
    return seen


def run(llm, prompts, params) -> tuple[list, list, np.ndarray]:
    """(token ids, (token, rank) of each logprob entry, the logprobs) of every request."""
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    entries = [[sorted(d.items()) for d in o.logprobs] for o in outs]
    return ([o.token_ids for o in outs], [[[(t, lp.rank) for t, lp in e] for e in es] for es in entries],
            np.array([lp.logprob for es in entries for e in es for _, lp in e]))


@pytest.mark.parametrize("kind", ["greedy", "seeded", "preempted"])
def test_padded_decode_equals_eager(llama_path, kind):
    engine = dict(dtype="float32", enforce_eager=True, max_num_seqs=12)
    if kind == "preempted":
        engine.update(num_kv_blocks=10, max_model_len=160)
    eager = LLM(llama_path, **engine)
    prompts = prompt_set(eager.get_tokenizer(), 12, seed=3, max_len=60)
    temp = dict(temperature=0.8, top_p=0.9, top_k=20) if kind == "seeded" else dict(temperature=0)
    # Different lengths: the batch shrinks through several buckets, most steps padded.
    params = [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True, logprobs=2, seed=i, **temp)
              for i in range(len(prompts))]
    padded = LLM(llama_path, **engine)
    seen = padded_rows(padded)
    tokens, ranks, logprobs = run(padded, prompts, params)
    ref_tokens, ref_ranks, ref_logprobs = run(eager, prompts, params)
    assert tokens == ref_tokens and ranks == ref_ranks
    # Not bitwise: CPU GEMMs round differently for a few rows (M <= 5) than for more, so a
    # padded batch of 8 and the same 5 rows alone differ in the last bits.
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=2e-5)
    padded_buckets = {rows for rows, n in seen if rows > n}
    if kind == "preempted":  # few sequences fit at once: small buckets only
        assert padded.llm_engine.get_stats().num_preemptions > 0 and padded_buckets, seen
    else:
        assert len(padded_buckets) >= 3, seen


class ForwardAsGraphs:
    """cuda_graphs.DecodeGraphs' stand-in on CPU: a 'replay' runs the forward captured for the
    bucket from the static buffers alone (padded_batch), which is all a real graph sees."""

    def __init__(self, forward, sizes):
        self.forward, self.sizes, self.replays = forward, set(sizes), []

    def __contains__(self, rows):
        return rows in self.sizes

    def replay(self, rows):
        self.replays.append(rows)
        return self.forward(rows)


def test_graph_mode_needs_nothing_but_the_static_buffers(llama_path, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", ForwardAsGraphs)
    engine = dict(dtype="float32", enforce_eager=True, max_num_seqs=6)
    eager = LLM(llama_path, **engine)
    prompts = prompt_set(eager.get_tokenizer(), 6, seed=4, max_len=40)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    graphed = LLM(llama_path, **engine)
    runner = graphed.llm_engine.executor.runner
    runner.prepare_decode_paths("graph")
    tokens, ranks, logprobs = run(graphed, prompts, params)
    ref_tokens, ref_ranks, ref_logprobs = run(eager, prompts, params)
    assert tokens == ref_tokens and ranks == ref_ranks
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=2e-5)
    assert {4, 6} <= set(runner.graphs.replays), runner.graphs.replays
    capture = runner.graph_capture  # what the start-up reports (throughput.py prints it)
    assert capture.sizes == len(runner.buckets) and capture.seconds > 0
    assert capture.reserved_bytes == 0  # no CUDA memory on CPU


# Graph replay against eager on a real GPU. fp32: cuBLAS may pick another kernel for a padded
# bucket than for the exact rows, so logprobs differ in the last bits only. bf16: that rounding
# is ~1e-2, enough to flip a near tie later on, so the first decode tokens must agree and
# logprobs only while the two agree.
GRAPH_LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.15}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(llama_path, dtype, monkeypatch):
    replays = []
    replay = cuda_graphs.DecodeGraphs.replay

    def counted(self, rows):
        replays.append(rows)
        return replay(self, rows)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "replay", counted)
    engine = dict(dtype=dtype, device="cuda", attention_backend="triton", max_num_seqs=12)
    eager = LLM(llama_path, enforce_eager=True, **engine)
    graphed = LLM(llama_path, enforce_eager=False, **engine)
    assert graphed.llm_engine.executor.runner.decode_mode == "graph"
    prompts = prompt_set(eager.get_tokenizer(), 12, seed=3, max_len=60)
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    if dtype == "float32":
        tokens, ranks, logprobs = run(graphed, prompts, params)
        ref_tokens, ref_ranks, ref_logprobs = run(eager, prompts, params)
        assert tokens == ref_tokens and ranks == ref_ranks
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=GRAPH_LOGPROB_TOL[dtype])
    else:
        got = [o.outputs[0] for o in graphed.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0] for o in eager.generate(prompts, params, use_tqdm=False)]
        for g, w in zip(got, want):
            assert g.token_ids[:2] == w.token_ids[:2]  # the prefill's token and the first replay's
            for pos, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
                if a != b:
                    break
                assert g.logprobs[pos][a].logprob == pytest.approx(w.logprobs[pos][b].logprob,
                                                                   abs=GRAPH_LOGPROB_TOL[dtype])
    assert len(set(replays)) >= 3, replays  # the batch shrank through several buckets
