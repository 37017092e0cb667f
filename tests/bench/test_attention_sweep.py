"""benchmarks/attention.py --sweep-tiles: what it prints from the timings of each tile (the
timings themselves need a GPU; the tiles' correctness is tests/kernels')."""
import importlib.util
import math
from pathlib import Path

import torch

from kernels.triton_attention_tuning import Tile, decode_tile

SPEC = importlib.util.spec_from_file_location(
    "attention_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)

TABLE = decode_tile(64, torch.float16)
OTHER, BROKEN = Tile(16, 32, 2, 3), Tile(16, 128, 8, 2)


def rows() -> list[dict]:
    base = dict(head_dim=64, table_tile=TABLE, auto_us=10.0)
    return [dict(base, tiles={TABLE: 10.0, OTHER: 8.0, BROKEN: math.nan}),
            dict(base, tiles={TABLE: 20.0, OTHER: 18.0, BROKEN: 1.0})]


def test_a_shape_line_names_the_best_tile_and_the_failed_ones():
    line = bench.format_sweep(rows()[0])
    assert f"best N32/w2/s3 8.0 us, table {bench.tile_name(TABLE)} 10.0 us (1.25x)" in line
    assert "failed or wrong output: N128/w8/s2" in line


def test_the_summary_picks_the_best_tile_over_all_shapes_it_ran_on(capsys):
    bench.summarize_sweep(rows())  # BROKEN is fastest once but failed once: not a candidate
    out = capsys.readouterr().out
    gain = math.sqrt(10 * 20 / (8 * 18))
    assert f"best tile over 2 shapes N32/w2/s3, {gain:.2f}x the table's {bench.tile_name(TABLE)}" in out
