"""Serving benchmark against any OpenAI-compatible endpoint (the metrics of vLLM's `bench serve`).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 \
        --dataset random --num-prompts 200 --input-len 128 --output-len 64 --request-rate 20

Streams every request (SSE), reports TTFT / TPOT / ITL / E2E (mean, median, std, p90, p99),
throughputs and the prefix-cache hit rate from /metrics, and writes result.json + result.png
under --result-dir. `--baselines serving_path,prefix_caching,continuous_batching` also runs the
in-process baselines on a local model directory (--engine-model, default the tokenizer).
`python run.py ... action=bench` does all of this for the deployment a config describes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import get_args

from flagserve.bench import report, suite
from flagserve.bench.client import Target
from flagserve.cluster import http
from flagserve.config.bench import check_workload
from flagserve.config.errors import ConfigError
from flagserve.config.schema import BENCH_BASELINES, BenchConfig, BenchDataset, BenchEndpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the `model` to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    p.add_argument("--endpoint", default="completions", choices=get_args(BenchEndpoint))
    p.add_argument("--tokenizer", help="local tokenizer directory or .gguf file (default: /v1/models' root)")
    p.add_argument("--dataset", default="random", choices=get_args(BenchDataset))
    p.add_argument("--dataset-path", help="jsonl: one {\"prompt\": ..., \"output_len\": ...} per line")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct prefixes, one drawn per request")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--baselines", default="", help=f"comma list of {', '.join(BENCH_BASELINES)}")
    p.add_argument("--engine-model", help="model directory of the in-process baselines")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="EngineArgs of the in-process baselines (repeatable), e.g. max_num_seqs=64")
    p.add_argument("--num-threads", type=int, help="torch threads of the in-process baselines")
    p.add_argument("--result-dir", default="outputs/bench", help="results go to <dir>/<time>/")
    p.add_argument("--label", default="HTTP", help="name of this server in the report")
    p.add_argument("--repeats", type=int, default=1,
                   help="serving_path: HTTP and in-process passes, pass p on prompts of seed + p; "
                        "overheads are medians over the passes")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.baselines = [b for b in args.baselines.split(",") if b]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.num_prefixes < 1:
        p.error("--num-prefixes must be >= 1")
    for b in args.baselines:
        if b not in BENCH_BASELINES:
            p.error(f"unknown baseline {b!r}; use {', '.join(BENCH_BASELINES)}")
    workload = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                if f.name in vars(args) and f.name != "baselines"}
    try:  # the same rules as action=bench's experiment.bench
        check_workload(BenchConfig(**workload))
    except ConfigError as err:
        p.error(f"--{err.key.rsplit('.', 1)[-1].replace('_', '-')} {err.message}")
    return args


def served_model(root: str, api_key: str | None) -> dict:
    return json.loads(http.get(f"{root}/v1/models", api_key, timeout=30))["data"][0]


def engine_args(args: argparse.Namespace, model_dir: str) -> dict:
    out: dict = {"model": model_dir}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return bench(args)
    except (OSError, RuntimeError) as err:  # the server down, or refusing the workload (warm-up)
        print(f"serve.py: {args.base_url}: {err}", file=sys.stderr)
        return 1


def bench(args: argparse.Namespace) -> int:
    target = Target(args.base_url, args.model or "", args.api_key, args.endpoint, not args.no_ignore_eos)
    info = {} if args.model and args.tokenizer else served_model(target.root, args.api_key)
    target.model = args.model or info["id"]
    tokenizer_dir = args.tokenizer or info.get("root")
    if not tokenizer_dir or not Path(tokenizer_dir).exists():
        print("need a local tokenizer directory or .gguf file: pass --tokenizer "
              f"(server said {tokenizer_dir!r})", file=sys.stderr)
        return 2
    from flagserve.models.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_dir)
    s = suite.Settings(args.dataset, args.dataset_path, args.num_prompts, args.input_len,
                       args.output_len, args.range_ratio, args.prefix_len, args.request_rate,
                       args.burstiness, args.max_concurrency, args.endpoint, not args.no_ignore_eos,
                       args.seed, args.warmup, args.baselines, not args.no_progress, args.repeats,
                       num_prefixes=args.num_prefixes)
    samples, offsets = suite.workload(s, tokenizer)
    rate = "inf" if s.request_rate == float("inf") else s.request_rate
    title = f"{target.model} at {target.root}: {s.dataset} x{len(samples)}, rate {rate}"
    runs = [suite.http_run(args.label, target, s, samples, offsets)]
    more_http = suite.http_passes(args.label, target, s, tokenizer)
    baselines = {}
    if s.baselines:
        eargs = engine_args(args, args.engine_model or tokenizer_dir)
        more, baselines = suite.run_baselines(runs[0], eargs, tokenizer, s, samples, offsets,
                                              args.num_threads, more_http)
        runs += more
    out_dir = Path(args.result_dir) / time.strftime("%Y%m%d-%H%M%S")
    files = suite.save(out_dir, title, s, runs, baselines,
                       {"model": target.model, "endpoint": target.url, "argv": sys.argv[1:]})
    print(report.table(runs[0].metrics, prefix_cache=runs[0].prefix_cache,
                             request_rate=s.request_rate, max_concurrency=s.max_concurrency))
    for line in suite.baseline_lines(baselines):
        print(line)
    print(f"results: {files['json']}\nfigures: " + ", ".join(str(p) for k, p in files.items() if k != "json"))
    return 0 if runs[0].metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
