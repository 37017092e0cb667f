"""Where FlagServe keeps what it builds once and reuses: the tiny models, GGUF tokenizers.

Kept free of torch: config resolution (every run.py command) asks where the tiny model is.
"""
from pathlib import Path

from flagserve.models.architectures import Arch
from kernels.env import cache_root

# Bump whenever the tiny model's recipe (corpus, sizes, init) changes: cached models live in a
# versioned directory, so a stale cache can never be mistaken for the current model.
RECIPE_VERSION = 2


def default_model_dir(arch: Arch = "llama") -> Path:
    """Cache location of the default tiny model: under $FLAGSERVE_CACHE or ~/.cache/flagserve."""
    return cache_root() / f"tiny-{arch}-v{RECIPE_VERSION}"
