"""The one way to load a model's tokenizer: from an HF directory, or from a GGUF file's metadata.

The engine's detokenizer, the ingress's PromptTokenizer and the benchmarks all call
load_tokenizer. transformers builds a GGUF's tokenizer (vocabulary, merges, special tokens,
chat template) in about 5 s for a 49k vocabulary; the result is saved once under the cache
(keyed by the file's path, size, mtime and the transformers version) and loads from there in
about 0.2 s, which matters because every engine and ingress replica loads it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from flagserve.models.cache import cache_root
from flagserve.models.config import model_format, transformers_location

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_VERSION = 1  # bump when what is cached changes


def prompt_vocab_size(model_vocab_size: int, tokenizer: PreTrainedTokenizerBase) -> int:
    """Token ids a prompt may hold: the tokenizer's, within the model's (a padded vocabulary's
    gap has embedding rows but no tokens: vLLM refuses such ids too)."""
    return min(model_vocab_size, len(tokenizer))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """`path`: an HF model or tokenizer directory, or a .gguf file."""
    from transformers import AutoTokenizer

    if model_format(path) == "hf":
        if not Path(path).is_dir():  # else transformers would fetch a Hub id of that name
            raise FileNotFoundError(f"no tokenizer directory {str(path)!r}: point `tokenizer` (or "
                                    "`model`) at a local HF directory or a .gguf file")
        return AutoTokenizer.from_pretrained(str(path))
    from flagserve.models.gguf_reader import read_gguf  # gguf + numpy: only for a .gguf model
    read_gguf(path)  # a missing or broken file: our one clear error, not transformers' trace
    cached = gguf_tokenizer_cache_dir(Path(path))
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    directory, gguf = transformers_location(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **gguf)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"GGUF file {str(path)!r}: cannot build its tokenizer: {err}") from None
    _save(tokenizer, cached)
    return tokenizer


def gguf_tokenizer_cache_dir(path: Path) -> Path:
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{CACHE_VERSION}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _save(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write to a temporary sibling and rename it into place: concurrent replicas never see a
    half-written tokenizer. A cache that cannot be written only costs the next load time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        pass  # another process published it first, or the disk is read-only
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_edges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_edges(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after a text it encodes (a BOS:
    (1, 0)): what a truncation of an encoded text keeps in place, as HF's does."""
    if tokenizer not in _edges:
        plain = tokenizer.encode("a", add_special_tokens=False)
        full = tokenizer.encode("a")
        head = next((i for i in range(len(full) - len(plain) + 1)
                     if full[i:i + len(plain)] == plain), 0)
        _edges[tokenizer] = (head, max(len(full) - head - len(plain), 0))
    return _edges[tokenizer]
