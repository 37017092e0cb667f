"""When each request is sent: a Poisson process at `request_rate` (or all at once).

As vLLM's bench: inter-arrival times are gamma distributed with shape `burstiness` and mean
1 / request_rate; burstiness 1 is a Poisson process, < 1 burstier, > 1 more uniform.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each request is sent; the first at 0."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
