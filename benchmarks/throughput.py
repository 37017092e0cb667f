"""Offline throughput, FlagServe vs HF transformers generate: flagserve/bench/throughput.py (--help).

    python benchmarks/throughput.py                     # CPU defaults, about a minute
"""
import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0] and its kernels.py (the kernel benchmark) would
# shadow the `kernels` package: put the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagserve.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
