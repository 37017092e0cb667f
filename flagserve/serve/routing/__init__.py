"""Choosing an engine replica per request: pure strategies (strategy.py, prefix.py) and
their Ray Serve adapter (ray_router.py)."""
