"""argparse types the benchmark command lines share."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A count of at least 1 (repetitions, layers): 0 would time nothing and print inf or nan."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
