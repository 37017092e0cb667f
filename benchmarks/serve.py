"""Serving benchmark against any OpenAI-compatible endpoint: flagserve/bench/cli.py (--help).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model tiny-llama
"""
import sys

from flagserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
