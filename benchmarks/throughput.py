"""Offline throughput, FlagServe vs HF transformers generate: flagserve/bench/throughput.py (--help).

    python benchmarks/throughput.py                     # CPU defaults, about a minute
    python benchmarks/throughput.py --shape qwen3-0.6b --dtype bfloat16 --num-seqs 256 \
        --input-len 100 1024 --output-len 100 1024      # random weights built on the device
    python benchmarks/throughput.py --shape llama3-8b --dtype bfloat16 --latency  # ms per token
"""

from flagserve.bench.throughput import main

if __name__ == "__main__":
    main()
