"""Offline throughput, FlagServe vs HF transformers generate: flagserve/bench/throughput.py (--help).

    .venv/bin/python benchmarks/throughput.py           # CPU defaults, about a minute
    .venv/bin/python benchmarks/throughput.py --shape qwen3-0.6b --dtype bfloat16 --num-seqs 256 \
        --input-len 100 1024 --output-len 100 1024      # random weights built on the device
    .venv/bin/python benchmarks/throughput.py --shape llama3-8b --dtype bfloat16 --latency
"""

from flagserve.bench.throughput import cli

if __name__ == "__main__":
    cli()
