"""The benchmarks, in small pieces; benchmarks/*.py are their command lines and run.py
action=bench (flagserve/runner/bench.py) drives the serving benchmark of a deployment.

    suite.py       one serving benchmark run with its baselines (what action=bench does)
    cli.py         the serving benchmark against any endpoint (python benchmarks/serve.py)
    datasets.py    random / shared-prefix / JSONL prompts with exact token counts
    schedule.py    Poisson (gamma) arrival times
    client.py      streams every request from an OpenAI-compatible endpoint (SSE), times tokens
    inprocess.py   the same workload and timing straight into LLMEngine (the baseline)
    metrics.py     TTFT / TPOT / ITL / E2E statistics as vLLM's `bench serve` defines them
    prom.py        prefix-cache counters read from /metrics
    report.py      the printed table and the JSON result
    plot.py        PNG figures
    throughput.py  offline throughput, FlagServe vs HF generate (python benchmarks/throughput.py)
"""
