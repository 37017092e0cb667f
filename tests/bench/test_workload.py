"""Datasets with exact token counts, the shared prefix, JSONL, and the Poisson schedule."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from transformers import AutoTokenizer

from flagserve.bench.datasets import (
    build_dataset,
    jsonl_dataset,
    lengths,
    random_dataset,
    shared_prefix_dataset,
)
from flagserve.bench.schedule import arrival_offsets


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


def test_random_prompts_have_exact_token_counts(tokenizer):
    samples = random_dataset(tokenizer, 60, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    assert len(samples) == 60
    for s in samples:
        # what the server sees for /v1/completions: encode() with special tokens (BOS)
        assert len(tokenizer.encode(s.text)) == s.prompt_len
        assert 50 <= s.prompt_len <= 150 and 10 <= s.output_len <= 30
    assert len({s.prompt_len for s in samples}) > 10  # the range ratio spreads them
    again = random_dataset(tokenizer, 60, 100, 20, 0.5, seed=1)
    assert [s.text for s in again] == [s.text for s in samples]  # reproducible by seed


def test_range_ratio_zero_gives_fixed_lengths(tokenizer):
    samples = random_dataset(tokenizer, 10, 64, 16, 0.0)
    assert {s.prompt_len for s in samples} == {64} and {s.output_len for s in samples} == {16}
    with pytest.raises(ValueError):
        lengths(10, 1.0, 3, __import__("random").Random(0))


def test_shared_prefix_is_a_token_prefix_of_every_prompt(tokenizer):
    samples = shared_prefix_dataset(tokenizer, 20, prefix_len=256, input_len=32, output_len=8, seed=3)
    prefix_ids = tokenizer.encode(samples[0].prefix)
    assert len(prefix_ids) == 256
    for s in samples:
        ids = tokenizer.encode(s.text)
        assert ids[:256] == prefix_ids and len(ids) == s.prompt_len == 256 + 32
    assert len({s.prompt for s in samples}) == 20  # distinct own parts


def test_jsonl_dataset(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Hello there", "output_len": 5}, {"prompt": "Second", "max_tokens": 7},
        {"prompt": "Third"}]) + "\n\n")
    samples = jsonl_dataset(path, None, 9, tokenizer)
    assert [(s.prompt, s.output_len) for s in samples] == [("Hello there", 5), ("Second", 7), ("Third", 9)]
    assert samples[0].prompt_len == len(tokenizer.encode("Hello there"))
    assert len(build_dataset("jsonl", tokenizer, 2, 1, 9, path=str(path))) == 2
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        jsonl_dataset(path, None, 9)


def test_poisson_schedule():
    offsets = arrival_offsets(4000, request_rate=20.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.1)  # exponential: std == mean
    assert arrival_offsets(5, 20.0, seed=0) == arrival_offsets(5, 20.0, seed=0)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    smooth = np.diff(arrival_offsets(4000, 20.0, burstiness=10.0, seed=0))
    assert smooth.mean() == pytest.approx(1 / 20, rel=0.05) and smooth.std() < gaps.std() / 2
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_each_pass_has_its_own_prompts(tokenizer):
    from flagserve.bench.suite import Settings, workload
    s = Settings(num_prompts=6, input_len=16, output_len=4, range_ratio=0.5, request_rate=5.0)
    first, again, second = workload(s, tokenizer), workload(s, tokenizer, 0), workload(s, tokenizer, 1)
    assert [x.text for x in first[0]] == [x.text for x in again[0]] and first[1] == again[1]
    assert not {x.text for x in first[0]} & {x.text for x in second[0]}  # no shared cache hits


def test_json_schema_dataset_carries_its_schemas_to_both_drivers(tokenizer, llama_path):
    """Random prompts as `random`, each request with a schema the HTTP body and the in-process
    engine both apply."""
    from flagserve.bench.client import Target
    from flagserve.bench.datasets import BENCH_SCHEMAS
    from flagserve.bench.inprocess import bench_engine
    from flagserve.engine.engine_args import EngineArgs
    from flagserve.engine.llm_engine import LLMEngine

    samples = build_dataset("json-schema", tokenizer, 5, 12, 24)
    assert [s.prompt for s in samples] == [s.prompt for s in random_dataset(tokenizer, 5, 12, 24)]
    assert [s.schema for s in samples] == [*BENCH_SCHEMAS, BENCH_SCHEMAS[0]]
    body = Target("http://x/v1", "m", endpoint="chat").body(samples[1])
    assert body["response_format"]["json_schema"]["schema"] == BENCH_SCHEMAS[1]
    engine = LLMEngine(EngineArgs(model=llama_path, dtype="float32"))
    results, _ = bench_engine(engine, samples[:4], [0.0] * 4, progress=False)
    assert all(r.success for r in results)
    # An open array runs to max_tokens: the schemas cost ITL, not output length.
    assert [r.output_len for r in results] == [24] * 4


def test_warm_up_sends_every_schema_once_before_the_timed_requests(tokenizer):
    """A timed constrained request must never pay its grammar's first compile: the warm-up
    holds the first `warmup` samples and then the first sample of each schema they miss."""
    from flagserve.bench.datasets import BENCH_SCHEMAS, SampleRequest, warmup_indices

    samples = build_dataset("json-schema", tokenizer, 9, 8, 8)
    assert warmup_indices(samples, 1) == [0, 1, 2, 3]
    assert warmup_indices(samples, 6) == [0, 1, 2, 3, 4, 5]
    assert {str(samples[i].schema) for i in warmup_indices(samples, 2)} == set(map(str, BENCH_SCHEMAS))
    assert warmup_indices(samples, 0) == []
    plain = [SampleRequest("x", 1, 4)] * 3
    assert warmup_indices(plain, 2) == [0, 1]


def test_the_warm_up_sends_no_timed_prompt():
    """Its prompts reversed: the timed run's first requests must not find themselves in the
    prefix cache (their TTFT and the hit rate would be the warm-up's); a shared prefix stays."""
    from flagserve.bench.datasets import SampleRequest, warmup_samples
    samples = [SampleRequest("first prompt", 3, 64, prefix="sys. "), SampleRequest("second", 2, None)]
    assert warmup_samples(samples, 2) == [SampleRequest("tpmorp tsrif", 3, 8, prefix="sys. "),
                                          SampleRequest("dnoces", 2, 8)]


def test_shared_prefix_with_several_prefixes_draws_one_per_request(tokenizer):
    """--num-prefixes: each prompt starts with one of the prefixes, drawn (not in turn, which
    round-robin routing over 2 replicas would keep on one replica each by accident)."""
    samples = shared_prefix_dataset(tokenizer, 40, prefix_len=64, input_len=8, output_len=4,
                                    seed=1, num_prefixes=4)
    prefixes = sorted({s.prefix for s in samples})
    assert len(prefixes) == 4
    for s in samples:
        assert len(tokenizer.encode(s.text)) == s.prompt_len == 64 + 8
    order = [prefixes.index(s.prefix) for s in samples]
    assert order != [i % 4 for i in range(40)] and any(a == b for a, b in zip(order, order[1:]))
    one = shared_prefix_dataset(tokenizer, 5, prefix_len=64, input_len=8, output_len=4, seed=1)
    assert len({s.prefix for s in one}) == 1


def test_an_ab_variant_with_threads_turns_the_thread_tuner_off():
    """cpu_ab.py's threads=N: the engine's tuner would otherwise choose the threads per step."""
    from flagserve.bench.ab import parse_variant
    from flagserve.engine.cpu_threads import TUNING_ENV
    one = parse_variant("one:threads=1,FOO=x,max_num_seqs=8")
    assert (one.threads, one.env, one.engine_args) == (1, {"FOO": "x", TUNING_ENV: "off"},
                                                       {"max_num_seqs": 8})
    assert TUNING_ENV not in parse_variant("base:FOO=x").env
    assert parse_variant(f"on:threads=2,{TUNING_ENV}=on").env[TUNING_ENV] == "on"  # as asked


@pytest.mark.parametrize("argv, words", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--range-ratio", "2"], "--range-ratio must be in [0, 1)"),
    (["--dataset", "jsonl"], "--dataset-path is not set"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
])
def test_serve_py_checks_its_workload_as_action_bench_does(argv, words, capsys):
    """benchmarks/serve.py's options by experiment.bench's rules: an argparse error, not a
    traceback mid-run (or a silent no-limit for a concurrency of 0)."""
    from flagserve.bench.cli import parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--base-url", "http://127.0.0.1:1", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_serve_py_against_no_server_says_so(capsys):
    """The server down (or refusing the warm-up): one line naming the URL, exit 1."""
    from flagserve.bench.cli import main
    assert main(["--base-url", "http://127.0.0.1:1", "--num-prompts", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("serve.py: http://127.0.0.1:1: ") and "Traceback" not in err


@pytest.mark.parametrize("spec, words", [("a:max_num_seq=8", "neither threads nor an EngineArgs field"),
                                         ("a:FOO", "is not KEY=VALUE")])
def test_an_ab_variant_that_would_fail_later_is_refused_when_parsed(spec, words):
    import argparse

    from flagserve.bench.ab import parse_variant
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse_variant(spec)

