"""What the runner, the serving process and the benchmarks all know of an experiment's
cluster: the records of what `run` started (records.py), the Ray environment it runs with
(ray_env.py) and how its servers are reached over HTTP (http.py). None of those layers owns
it, so none imports another."""
