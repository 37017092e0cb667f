"""The run's logs/ray link into the live Ray session, next to what earlier runs kept."""
from types import SimpleNamespace

from flagserve.runner.ray_logs import remove_ray_temp_dir
from flagserve.serve.server import _link_ray_logs


def test_a_second_run_keeps_the_first_runs_logs(tmp_path):
    # run 1 links its session, stop copies the logs in place of the link; run 2 must start
    # (it failed with IsADirectoryError) and keep run 1's logs beside its own link.
    logs = tmp_path / "logs"
    logs.mkdir()
    paths = SimpleNamespace(logs=logs)
    for run in (1, 2, 3):
        temp = tmp_path / f"ray-temp-{run}"
        session_logs = temp / "session_2026" / "logs"
        session_logs.mkdir(parents=True)
        (session_logs / "raylet.out").write_text(f"run {run}\n")
        _link_ray_logs(paths, session_logs)
        assert (logs / "ray").is_symlink() and (logs / "ray" / "raylet.out").read_text() == f"run {run}\n"
        remove_ray_temp_dir(temp, logs / "ray")
    assert [(logs / d / "session_2026" / "raylet.out").read_text() for d in ("ray.1", "ray.2", "ray")] == [
        "run 1\n", "run 2\n", "run 3\n"]
