"""The combined table of a Hydra multirun: one row per point, the serving-path overhead
columns when the points ran that baseline."""
from __future__ import annotations

from flagserve.bench.metrics import RequestResult, compute
from flagserve.runner import bench


def test_sweep_table_shows_serving_path_overhead(tmp_path, capsys, monkeypatch):
    metrics = compute([RequestResult(True, 10, 5, 0.0, 0.002, 0.01, [0.002] * 4)], 1.0)
    points = []
    for i, (ttft, itl) in enumerate([(10.5, 142.0), (1.75, 12.5)]):
        points.append({"overrides": [f"experiment.runner.deploy.http_server={'ab'[i]}"],
                       "dir": str(tmp_path / str(i)), "result_dir": str(tmp_path),
                       "metrics": metrics, "title": "t",
                       "baselines": {"serving_path": {"ttft_overhead_ms": ttft,
                                                      "itl_overhead_pct": itl}}})
    monkeypatch.setattr(bench, "SWEEP", points)
    bench.finish_sweep()
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("point"))
    assert "TTFT +ms" in header and "ITL +%" in header
    rows = [line for line in out.splitlines() if "http_server=" in line]
    assert "10.50" in rows[0] and "142.00" in rows[0] and "12.50" in rows[1]
    assert list(tmp_path.glob("sweep-*/sweep.png"))
