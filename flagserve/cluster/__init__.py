"""What the runner and the serving process both know of an experiment's cluster: the records
of what `run` started (records.py) and the Ray environment it runs with (ray_env.py). Neither
layer owns it, so neither imports the other."""
