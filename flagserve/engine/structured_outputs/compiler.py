"""Grammar compilation off the step loop, once per distinct constraint (in the grammar process).

Compiling a grammar against the vocabulary takes milliseconds to seconds (large schemas), far
longer than a decode step, so it runs on a small thread pool (xgrammar's C++ compiler releases
the GIL) while the engine keeps stepping; the request waits, not the batch. Results are kept
in an LRU keyed by (kind, canonical spec): a server sees the same few schemas again and again.
The cache holds futures, so concurrent requests with one schema share one compilation.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flagserve.engine.structured_outputs.params import Kind, parse_grammar

CACHE_SIZE = 128  # distinct compiled grammars kept; a compiled JSON schema is typically < 1 MB
COMPILE_THREADS = 2


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = CACHE_SIZE):
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler = None  # built on first use: scanning the vocabulary takes ~0.2 s for 49k tokens
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Kind, str], Future] = OrderedDict()
        self._cache_size = cache_size
        # Counted under the lock; read unlocked by the stats (ints: a torn read cannot happen).
        self.requests, self.cache_hits = 0, 0  # cumulative: submits, of which served from the cache
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")

    def submit(self, kind: Kind, spec: str) -> Future:
        """A future of the xgrammar.CompiledGrammar of a constraint (StructuredOutputsParams'
        kind and spec()); a cached one when seen before."""
        key = (kind, spec)
        with self._lock:
            self.requests += 1
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                self.cache_hits += 1  # a compilation still running counts: it is shared
                return future
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, kind: Kind, spec: str) -> Any:
        return self._xgr_compiler().compile_grammar(parse_grammar(kind, spec))

    def _xgr_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids)
                # Our own LRU above decides what stays; xgrammar's cache would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
