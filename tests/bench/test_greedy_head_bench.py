"""benchmarks/greedy_head.py (flagserve/bench/greedy_head.py): one table row per row count,
each call's time and the float32 head's over each approximation's."""
import re
import sys

import pytest
import torch

from flagserve.bench import greedy_head
from kernels import cpu_native


@pytest.mark.skipif(torch.cuda.is_available() or not cpu_native.available(),
                    reason="the native kernels are CPU-only and need a C++ compiler")
def test_prints_a_row_per_row_count(llama_path, monkeypatch, capsys):
    monkeypatch.setattr(greedy_head, "COLD_BYTES", 1 << 20)
    monkeypatch.setattr(sys, "argv", ["greedy_head.py", "--model", llama_path, "--rows", "1", "5",
                                      "--reps", "2", "--approximations", "int8", "bf16"])
    greedy_head.main()
    lines = capsys.readouterr().out.splitlines()
    assert "| rows | float32 head + argmax | int8 | bf16 | float32 / int8 | float32 / bf16 |" in lines
    number, ratio = r"\d+\.\d\d", r"\d+\.\d\dx"
    for rows in (1, 5):
        row = rf"\| {rows} \| {number} \| {number} \| {number} \| {ratio} \| {ratio} \|"
        assert any(re.fullmatch(row, line) for line in lines), lines
