"""action=bench config: experiment.bench is schema-checked like the rest (exit 2, one message
naming the key), before anything starts."""
from __future__ import annotations

import math

import pytest

from flagserve.config.schema import BENCH_BASELINES
from flagserve.runner.cli import EXIT_CONFIG, execute, load
from tests.serve.test_config import composed


def test_defaults_and_overrides_parse(tmp_path):
    config, _ = load(composed("action=bench"))
    b = config.experiment.bench
    assert b.dataset == "random" and b.num_prompts >= 1 and list(b.baselines) == list(BENCH_BASELINES)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    config, _ = load(composed(
        "action=bench", "experiment.bench.request_rate=inf", "experiment.bench.dataset=jsonl",
        f"experiment.bench.dataset_path={tmp_path / 'p.jsonl'}", "experiment.bench.max_concurrency=8",
        "experiment.bench.baselines=[serving_path]", "experiment.bench.endpoint=chat"))
    b = config.experiment.bench
    assert math.isinf(b.request_rate) and b.max_concurrency == 8 and b.baselines == ["serving_path"]
    assert b.dataset_path == str(tmp_path / "p.jsonl") and b.endpoint == "chat"


@pytest.mark.parametrize("overrides,key,words", [
    (["experiment.bench.dataset=sharegpt"], "experiment.bench.dataset", "random, shared-prefix, jsonl"),
    (["experiment.bench.dataset=jsonl"], "experiment.bench.dataset_path", "is not set"),
    (["experiment.bench.dataset=jsonl", "experiment.bench.dataset_path=/no/such.jsonl"],
     "experiment.bench.dataset_path", "does not exist"),
    (["experiment.bench.num_prompts=0"], "experiment.bench.num_prompts", ">= 1"),
    (["experiment.bench.num_prompts=many"], "experiment.bench.num_prompts", "integer"),
    (["experiment.bench.request_rate=0"], "experiment.bench.request_rate", "> 0"),
    (["experiment.bench.request_rate=fast"], "experiment.bench.request_rate", "number"),
    (["experiment.bench.range_ratio=1.5"], "experiment.bench.range_ratio", "[0, 1)"),
    (["experiment.bench.max_concurrency=0"], "experiment.bench.max_concurrency", ">= 1"),
    (["experiment.bench.endpoint=embeddings"], "experiment.bench.endpoint", "completions, chat"),
    (["experiment.bench.baselines=[vllm]"], "experiment.bench.baselines", "serving_path"),
    (["experiment.bench.module=nope"], "experiment.bench.module", "llm"),
    (["+experiment.bench.num_promts=3"], "experiment.bench.num_promts", "did you mean `num_prompts`"),
    (["experiment.bench.compare_base_url=localhost:8001"], "experiment.bench.compare_base_url", "http"),
    (["experiment.bench.repeats=0"], "experiment.bench.repeats", ">= 1"),
    (["experiment.bench.num_prefixes=0"], "experiment.bench.num_prefixes", ">= 1"),
])
def test_bad_bench_config(capsys, overrides, key, words):
    code = execute(composed("action=bench", *overrides))
    out, err = capsys.readouterr()
    assert code == EXIT_CONFIG, (out, err)
    assert f"`{key}`" in err and words in err, err
    assert "Traceback" not in err and "starting" not in out
