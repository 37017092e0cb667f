"""Prefill and decode engines in different processes (or hosts), over torch.distributed
point-to-point: gloo on CPU, NCCL on GPU. Any number of each (xPyD).

A prefill endpoint hosts a TCPStore at `address` (port 0: any free port) and names itself
`<mode>://<host>:<port>` in its handoffs' `source`. A decode endpoint keeps one link per
source, made on the first fetch from it (p2p_pair.py: a pair per decode x prefill engine that
exchanged a request), or at start for a configured `address`. A link that fails is dropped and
made again on the next fetch from that source: a dead prefill engine is refused at once, a
restarted one has a new name, and a restarted decode engine joins as a new pair. Every store
read and data receive is bounded by timeout_s, so a fetch fails instead of hanging.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from flagserve.engine.kv_transfer.cache_io import KVCaches
from flagserve.engine.kv_transfer.config import KVTransferConfig
from flagserve.engine.kv_transfer.p2p_pair import (
    IDLE_WAIT_S,
    PairLink,
    PairServer,
    gpu_id,
    pair_mode,
    store_client,
)
from flagserve.engine.kv_transfer.transport import KVEndpoint

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 5.0  # a source that named itself is up: connecting to it is quick


class P2PTransport(KVEndpoint):
    def __init__(self, config: KVTransferConfig, cuda: bool):
        self.mode = config.resolved_mode(cuda)
        self.config = config
        self._store: dist.TCPStore | None = None
        if config.role == "prefill":  # bound now: the name carries the port
            host, port = config.host_port
            self._store = dist.TCPStore(host, port, None, True,
                                        timedelta(seconds=config.connect_timeout_s),
                                        wait_for_workers=False)
            name = f"{self.mode}://{host}:{self._store.port}"
        else:
            name = f"{self.mode}://{config.address}" if config.address else f"{self.mode}://decode"
        super().__init__(name, config.offer_timeout_s)
        self._servers: list[PairServer] = []
        self._acceptor: threading.Thread | None = None
        self._links: dict[str, PairLink] = {}  # source -> link; each used by its fetcher only
        self._connect_error: Exception | None = None
        self.connected = threading.Event()  # set once a pair is up

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.name.split("://", 1)[1].rpartition(":")
        return host, int(port)

    def bind(self, caches: KVCaches | None) -> None:
        super().bind(caches)
        if self.config.role == "prefill":
            self._acceptor = threading.Thread(target=self._accept, name="kv-accept", daemon=True)
            self._acceptor.start()
        elif self.config.address:  # the one prefill engine it was told of: connect now
            self._fetcher_of(self.name)
        if self.config.wait_connected:
            self._wait_connected()

    def _wait_connected(self) -> None:
        """Until a pair is up; raises if none is within connect_timeout_s."""
        peer = "decode" if self.config.role == "prefill" else "prefill"
        deadline = time.monotonic() + self.config.connect_timeout_s
        while not self.connected.wait(0.2):
            if self._connect_error is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"no {peer} engine connected to the KV endpoint {self.config.address} within "
                    f"{self.config.connect_timeout_s:g} s: {self._connect_error or 'timed out'}")

    @property
    def _device(self) -> torch.device | None:
        return self.caches.device if self.caches is not None else None

    # Prefill side: a PairServer per decode endpoint that joins

    def _accept(self) -> None:
        try:
            client = store_client(*self.address, self.config.connect_timeout_s)
        except Exception as err:  # noqa: BLE001 - unanswered offers expire, their blocks are freed
            self._connect_error = err
            log.error("KV transfer server at %s could not start: %s", self.name, err)
            return
        gpu = gpu_id(self._device)
        client.set("gpu", json.dumps({"gpu": gpu}))
        k = 0
        while True:
            try:
                client.wait([f"hello/{k}"], timedelta(seconds=IDLE_WAIT_S))
            except dist.DistStoreError:
                continue  # idle
            hello = json.loads(client.get(f"hello/{k}"))
            if hello.get("close"):
                return
            mode = pair_mode(self.mode, gpu, hello.get("gpu"))
            server = PairServer(k, self.address, mode, self.config.timeout_s, self.serve,
                                self.connected.set, self._device)
            self._servers.append(server)
            server.thread.start()
            k += 1

    # Decode side: a link per source, on that source's fetcher thread

    def _fetch_loop(self, source: str, jobs) -> None:
        try:
            self._link(source)
        except Exception as err:  # noqa: BLE001 - its first fetch tries again, and fails with why
            self._connect_error = err
        super()._fetch_loop(source, jobs)

    def _link(self, source: str) -> PairLink:
        link = self._links.get(source)
        if link is not None:
            return link
        mode, _, address = source.partition("://")
        host, _, port = address.rpartition(":")
        if mode != self.mode or not port.isdigit():
            raise RuntimeError(f"{source!r} is not a {self.mode} KV endpoint")
        # The configured peer, at start, may still be loading its model: patience. Any other
        # source named itself in a handoff (or was met before): it is up, or gone.
        patient = source == self.name and not self.connected.is_set()
        if not patient:  # refused at once when it is gone, instead of timeout_s of retries
            socket.create_connection((host, int(port)), PROBE_TIMEOUT_S).close()
        timeout = self.config.connect_timeout_s if patient else self.config.timeout_s
        link = PairLink((host, int(port)), self.mode, self.config.timeout_s, timeout, self._device)
        self._links[source] = link
        self.connected.set()
        return link

    def _receive(self, request_id: str, source: str, num_blocks: int) -> torch.Tensor:
        link = self._link(source)
        try:
            data, error = link.receive(request_id, self.caches.empty(num_blocks))
        except Exception:  # a dead or stuck peer: the next fetch from it joins anew
            self._links.pop(source, None)
            raise
        if error is not None:
            raise RuntimeError(error)
        return data

    def _closed(self, source: str) -> None:
        link = self._links.pop(source, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        super().close()  # the fetchers close their links: each peer's server stops
        if self._acceptor is not None:
            try:
                waker = store_client(*self.address, 5)
                waker.set(f"hello/{waker.add('peers', 1) - 1}", '{"close": true}')
            except RuntimeError:  # torch.distributed's DistError: the store is gone already
                pass
            for server in self._servers:
                server.stop()
            # Joined before the store goes: a thread left waiting on it aborts the process.
            for thread in [self._acceptor, *(s.thread for s in self._servers)]:
                thread.join(timeout=5)
            self._acceptor = None
