"""Where FlagServe keeps what it builds once and reuses: the tiny models, GGUF tokenizers."""
import os
from pathlib import Path


def cache_root() -> Path:
    """$FLAGSERVE_CACHE, else ~/.cache/flagserve."""
    return Path(os.environ.get("FLAGSERVE_CACHE") or Path.home() / ".cache" / "flagserve")
