"""Offline throughput, FlagServe vs HF transformers generate: flagserve/bench/throughput.py (--help).

    python benchmarks/throughput.py                     # CPU defaults, about a minute
"""

from flagserve.bench.throughput import main

if __name__ == "__main__":
    main()
