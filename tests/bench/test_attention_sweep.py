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
    base = dict(kind="decode", head_dim=64, table_tile=TABLE, auto_us=10.0)
    return [dict(base, tiles={TABLE: 10.0, OTHER: 8.0, BROKEN: math.nan}),
            dict(base, tiles={TABLE: 20.0, OTHER: 18.0, BROKEN: 1.0})]


def test_a_shape_line_names_the_best_tile_and_the_failed_ones():
    line = bench.format_sweep(rows()[0])
    assert f"best N32/w2/s3 8.0 us, table {bench.tile_name(TABLE)} 10.0 us (1.25x)" in line
    assert "failed or wrong output: N128/w8/s2" in line


def test_a_lazy_best_tile_names_its_eager_twin():
    lazy = Tile(128, 128, 8, 2, lazy_rescale=True)
    row = dict(kind="extend", head_dim=128, table_tile=Tile(128, 32, 4, 2), triton_us=24.0,
               tiles={Tile(128, 32, 4, 2): 24.0, lazy: 21.6, Tile(128, 128, 8, 2): 22.8})
    assert "best M128/N128/w8/s2/lazy 21.6 us, table M128/N32/w4/s2 24.0 us (1.11x); " \
        "M128/N128/w8/s2 22.8 us" in bench.format_sweep(row)


def test_the_summary_picks_the_best_tile_over_all_shapes_it_ran_on(capsys):
    bench.summarize_sweep(rows())  # BROKEN is fastest once but failed once: not a candidate
    out = capsys.readouterr().out
    gain = math.sqrt(10 * 20 / (8 * 18))
    assert (f"decode D=64: best tile over 2 shapes N32/w2/s3, {gain:.2f}x the table's "
            f"{bench.tile_name(TABLE)}") in out


def test_prefill_and_extend_are_summarised_apart(capsys):
    """Prefill rows name their tiles' rows (BLOCK_M, which the sweep varies); prefill and
    extend get a line each, every one from its own shapes."""
    table, wide = Tile(128, 32, 4, 2), Tile(64, 64, 4, 3)
    base = dict(head_dim=128, table_tile=table, triton_us=10.0)
    bench.summarize_sweep([dict(base, kind="prefill", tiles={table: 10.0, wide: 5.0}),
                           dict(base, kind="extend", tiles={table: 10.0, wide: 20.0})])
    out = capsys.readouterr().out
    assert "prefill D=128: best tile over 1 shapes M64/N64/w4/s3, 2.00x the table's M128/N32/w4/s2" in out
    assert "extend D=128: best tile over 1 shapes M128/N32/w4/s2, 1.00x" in out


def test_a_split_sweep_line_names_the_best_count_against_the_wrappers():
    row = dict(splits=1, auto_us=20.0, by_splits={1: 20.0, 2: 19.5, 8: 10.0})
    line = bench.format_splits(row)
    assert "best 8 10.0 us, the wrapper's 1 20.0 us (2.00x); 1:20.0 2:19.5 8:10.0" in line


def test_decode_order_table(capsys):
    """`--only decode-order` on a tiny shape (the interpreter on CPU: timings mean nothing)."""
    args = bench.argparse.Namespace(cuda_graph=False, dtype="float32", contexts=[40], batches=[3])
    bench.run_decode_order(args, bench.Shape(4, 2, 32, 16), torch.float32, torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))
    out = capsys.readouterr().out
    assert "     3       40 " in out and "decode order: longest first" in out
    assert "geometric mean of 1 shapes" in out
