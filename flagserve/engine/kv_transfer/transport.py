"""The transport interface, and the bookkeeping every transport shares (KVEndpoint).

Prefill side: `offer` a request's blocks; `serve` copies them out for a fetcher and reports
the request "sent" (its blocks may be freed from then on); `withdraw` on abort frees them at
once unless a copy is under way. An offer nobody fetches expires. Decode side: `fetch` queues
a receive into already-allocated blocks on the endpoint's own thread, so transfers never
block the engine's step loop, and reports the request "received" (or its error). The engine
learns both through `poll()`, on its own thread: it alone touches its block manager.

A decode endpoint fetches from any number of prefill endpoints (xPyD): one fetcher thread per
source, so a slow or dead prefill engine delays only the requests it produced.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch

from flagserve.engine.kv_transfer.cache_io import KVCaches

log = logging.getLogger(__name__)
TransferSide = Literal["sent", "received"]


@dataclass
class TransferDone:
    request_id: str
    side: TransferSide
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class TransferStats:
    """Cumulative, for metrics: KV bytes each way, time spent receiving, failed transfers."""
    bytes_sent: int = 0
    bytes_received: int = 0
    receive_seconds: float = 0.0
    requests_sent: int = 0
    requests_received: int = 0
    failures: int = 0


class KVEndpoint:
    def __init__(self, name: str, offer_timeout_s: float):
        self.name = name  # what a RequestHandoff's `source` names
        self.offer_timeout_s = offer_timeout_s
        self.caches: KVCaches | None = None
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._offers: dict[str, tuple[list[int], float]] = {}  # request -> (blocks, deadline)
        self._done: queue.SimpleQueue[TransferDone] = queue.SimpleQueue()
        self._wake = threading.Event()
        # source -> its fetcher thread and job queue (None: stop)
        self._fetchers: dict[str, tuple[threading.Thread, queue.SimpleQueue]] = {}

    def bind(self, caches: KVCaches) -> None:
        self.caches = caches

    # Prefill side

    def offer(self, request_id: str, blocks: list[int]) -> None:
        with self._lock:
            self._offers[request_id] = (list(blocks), time.monotonic() + self.offer_timeout_s)

    def withdraw(self, request_id: str) -> bool:
        """True: the blocks are no longer readable and may be freed now. False: a copy is under
        way (or finished): a "sent" TransferDone follows, and frees them."""
        with self._lock:
            return self._offers.pop(request_id, None) is not None

    def serve(self, request_id: str, num_blocks: int) -> tuple[torch.Tensor | None, str | None]:
        """The offered blocks' K/V copied out, or an error for the fetcher."""
        with self._lock:
            entry = self._offers.pop(request_id, None)
        if entry is None:
            return None, f"no KV is offered for request {request_id!r} (aborted, expired or unknown)"
        blocks = entry[0]
        try:
            if len(blocks) != num_blocks:
                raise ValueError(f"the fetcher expects {num_blocks} blocks, {len(blocks)} are offered")
            data = self.caches.gather(blocks)
        except Exception as err:  # noqa: BLE001 - reported to both engines, this request only
            self._post(TransferDone(request_id, "sent", f"reading its KV failed: {err}"))
            return None, f"the prefill engine could not read the KV of {request_id!r}: {err}"
        self._post(TransferDone(request_id, "sent", None, data.nbytes))
        return data, None

    # Decode side

    def fetch(self, request_id: str, source: str, blocks: list[int]) -> None:
        self._fetcher_of(source).put((request_id, list(blocks)))

    def _fetcher_of(self, source: str) -> queue.SimpleQueue:
        with self._lock:
            if source not in self._fetchers:
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                thread = threading.Thread(target=self._fetch_loop, args=(source, jobs),
                                          name=f"kv-fetch-{source}", daemon=True)
                self._fetchers[source] = (thread, jobs)
                thread.start()
            return self._fetchers[source][1]

    def _fetch_loop(self, source: str, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            request_id, blocks = job
            start = time.perf_counter()
            try:
                data = self._receive(request_id, source, len(blocks))
                self.caches.scatter(blocks, data)
                done = TransferDone(request_id, "received", None, data.nbytes,
                                    time.perf_counter() - start)
            except Exception as err:  # noqa: BLE001 - fails this request only
                done = TransferDone(request_id, "received", f"the KV transfer of request "
                                    f"{request_id!r} from {source} failed: {err}")
            self._post(done)
        self._closed(source)

    def _receive(self, request_id: str, source: str, num_blocks: int) -> torch.Tensor:
        """The K/V of request_id's blocks from `source`: each transport's own."""
        raise NotImplementedError

    def _closed(self, source: str) -> None:
        """The fetcher of `source` stopped (close): a transport's own link teardown."""

    # Both

    def _post(self, done: TransferDone) -> None:
        s = self.stats
        if done.error is not None:
            log.error("%s", done.error)
        with self._lock:  # posted from the transfer threads and the engine's
            if done.error is not None:
                s.failures += 1
            elif done.side == "sent":
                s.bytes_sent, s.requests_sent = s.bytes_sent + done.nbytes, s.requests_sent + 1
            else:
                s.bytes_received += done.nbytes
                s.requests_received += 1
                s.receive_seconds += done.seconds
        self._done.put(done)
        self._wake.set()

    def poll(self) -> list[TransferDone]:
        """Transfers finished since the last poll; offers past their deadline expire here."""
        now = time.monotonic()
        with self._lock:
            expired = [r for r, (_, deadline) in self._offers.items() if deadline < now]
            for request_id in expired:
                del self._offers[request_id]
        for request_id in expired:
            self._post(TransferDone(request_id, "sent", f"no decode engine fetched the KV of "
                                    f"{request_id!r} within {self.offer_timeout_s:g} s"))
        out = []
        while not self._done.empty():
            out.append(self._done.get())
        return out

    def wait(self, timeout: float) -> None:
        """Until a transfer finishes or `timeout`: an engine with only transfers pending idles."""
        self._wake.wait(timeout)
        self._wake.clear()

    def close(self) -> None:
        with self._lock:
            fetchers, self._fetchers = list(self._fetchers.values()), {}
        for _, jobs in fetchers:
            jobs.put(None)
        for thread, _ in fetchers:
            thread.join(timeout=5)
