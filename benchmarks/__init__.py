"""Benchmarks: offline throughput (throughput.py) and serving (serve.py, serving/)."""
