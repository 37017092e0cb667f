"""The serving benchmark, in small pieces (the CLI is benchmarks/serve.py; run.py action=bench
uses the same pieces):

    datasets.py   random / shared-prefix / JSONL prompts with exact token counts
    schedule.py   Poisson (gamma) arrival times
    client.py     streams every request from an OpenAI-compatible endpoint (SSE), times tokens
    inprocess.py  the same workload and timing straight into LLMEngine (the baseline)
    metrics.py    TTFT / TPOT / ITL / E2E statistics as vLLM's `bench serve` defines them
    prom.py       prefix-cache counters read from /metrics
    report.py     the printed table and the JSON result
    plot.py       PNG figures
"""
