"""The benchmark command lines' shared argparse types: a bad value is one argparse line."""
import argparse
import math
import sys

import pytest

from flagserve.bench.args import positive_int, positive_rate, vllm_python


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "x"])
def test_positive_int_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "-inf", "fast"])
def test_positive_rate_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_rate(text)


def test_positive_rate_takes_inf_and_numbers():
    assert positive_rate("inf") == math.inf and positive_rate("2.5") == 2.5


def test_vllm_python_refuses_a_missing_interpreter(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="not an executable"):
        vllm_python(str(tmp_path / "bin" / "python"))


def test_vllm_python_refuses_an_interpreter_without_vllm():
    # the test venv never has vLLM (it is never a dependency of the project)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot find vllm"):
        vllm_python(sys.executable)
