"""Serving benchmark against any OpenAI-compatible endpoint: flagserve/bench/cli.py (--help).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model tiny-llama
"""
import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0] and its kernels.py (the kernel benchmark) would
# shadow the `kernels` package: put the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagserve.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
