"""What a model on CPU gets after loading (issue 16): its linear layers and LM head packed
for oneDNN (layers/cpu_matmul.py; FLAGSERVE_CPU_MATMUL). GPU models are left alone."""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from flagserve.layers.cpu_matmul import matmul_mode

log = logging.getLogger(__name__)


def pack_linear_weights(model: nn.Module) -> int:
    """Every layer that can multiply by a packed weight does from now on; returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "pack_for_cpu")]
    for layer in layers:
        layer.pack_for_cpu()
    return len(layers)


def prepare_cpu_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cpu":
        return
    if matmul_mode(device, dtype) == "onednn":
        start = time.perf_counter()
        count = pack_linear_weights(model)
        log.info("packed %d weights for oneDNN in %.2f s", count, time.perf_counter() - start)
