"""Shared fixtures: tiny random-weight HF models (no downloads) and HF reference runs."""
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run in triton's interpreter, which must be switched on
# before any kernel module is imported (triton decides when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flagserve.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(arch, **config_overrides) -> model directory, built once per key."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(out, arch=arch, seed=0, **overrides)
        return str(built[key])

    return make


@pytest.fixture(scope="session")
def llama_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def prompt_set(tokenizer, count: int, seed: int = 0, min_len: int = 3, max_len: int = 90) -> list[list[int]]:
    """`count` token-id prompts of mixed lengths drawn from real text, reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    text = ("The weather today is sunny and the river is calm, so we cook rice with beans, "
            "count to 42 and write code on old computers before the rain comes back. ") * 8
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for _ in range(count):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        start = int(torch.randint(0, len(ids) - n, (1,), generator=gen))
        prompts.append(ids[start:start + n])
    return prompts
