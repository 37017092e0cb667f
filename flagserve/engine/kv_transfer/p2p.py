"""One prefill engine and one decode engine in different processes (or hosts), over
torch.distributed point-to-point: gloo on CPU, NCCL on GPU.

The prefill side (rank 0) hosts a TCPStore at `address`; both join a private two-rank process
group (never the default group, so shard groups of TP/PP are untouched). Control messages go
through the store: the decode side writes fetch/<n> = {request, blocks}, the prefill side's
server thread answers reply/<n> = {error} and, when it has the KV, sends it as one tensor
tagged n. Every store read and data receive of the fetcher is bounded by timeout_s, and a
peer that dies closes its sockets, so a fetch fails instead of hanging.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from flagserve.engine.kv_transfer.cache_io import KVCaches
from flagserve.engine.kv_transfer.config import KVTransferConfig
from flagserve.engine.kv_transfer.transport import KVEndpoint

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 600.0  # the peer replica may start minutes later (loading weights)
IDLE_WAIT_S = 3600.0  # the server's wait for the next fetch; each timeout only logs a warning
PREFILL, DECODE = 0, 1


def make_group(store: dist.Store, rank: int, mode: str, timeout: timedelta) -> dist.ProcessGroup:
    if mode == "nccl":  # CUDA only (its own default timeout): cannot run on CPU-only machines
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class P2PTransport(KVEndpoint):
    def __init__(self, config: KVTransferConfig, cuda: bool):
        self.mode = config.resolved_mode(cuda)
        super().__init__(f"{self.mode}://{config.address}", config.offer_timeout_s)
        self.config = config
        self.rank = PREFILL if config.role == "prefill" else DECODE
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._next = 0  # index of the next message (the decode side assigns, both count)
        self._server: threading.Thread | None = None
        self._connect_error: Exception | None = None
        self._lost: Exception | None = None  # why the link broke, once it has
        self.connected = threading.Event()  # set once both ranks have met

    def bind(self, caches: KVCaches) -> None:
        super().bind(caches)
        if self.rank == PREFILL:
            self._server = threading.Thread(target=self._serve_loop, name="kv-serve", daemon=True)
            self._server.start()
        else:  # connect now, on the fetcher: the peer's rendezvous waits for both ranks
            self._start_fetcher()

    def _connect(self) -> None:
        if self.mode == "nccl":
            torch.cuda.set_device(self.caches.device)
        host, port = self.config.host_port
        self._store = dist.TCPStore(host, port, 2, self.rank == PREFILL,
                                    timedelta(seconds=CONNECT_TIMEOUT_S))
        timeout = timedelta(seconds=self.config.timeout_s)
        self._group = make_group(dist.PrefixStore("kv-group", self._store), self.rank, self.mode, timeout)
        self._store.set_timeout(timeout)
        self.connected.set()

    # Prefill side: one server thread answering fetches in order

    def _serve_loop(self) -> None:
        try:
            self._connect()
            self._serve_fetches()
        except Exception as err:  # noqa: BLE001 - unanswered offers expire, their blocks are freed
            log.error("KV transfer server at %s stopped: %s", self.config.address, err)

    def _serve_fetches(self) -> None:
        while True:
            key = f"fetch/{self._next}"
            try:
                self._store.wait([key], timedelta(seconds=IDLE_WAIT_S))
            except dist.DistStoreError:
                continue  # idle
            message = json.loads(self._store.get(key))
            self._store.delete_key(key)
            if message.get("close"):
                return
            self._answer(message["request_id"], message["num_blocks"])
            self._next += 1

    def _answer(self, request_id: str, num_blocks: int) -> None:
        data, error = self.serve(request_id, num_blocks)
        self._store.set(f"reply/{self._next}", json.dumps({"error": error}))
        if data is None:
            return
        try:
            self._group.send([data], DECODE, self._next % 2**31).wait()
        except Exception as err:  # noqa: BLE001 - the fetcher fails this request on its side
            log.error("KV transfer: sending %r failed: %s", request_id, err)

    # Decode side: the fetcher thread, one fetch after another

    def _fetch_loop(self) -> None:
        try:
            self._connect()
        except Exception as err:  # noqa: BLE001 - every fetch fails with this error
            self._connect_error = err
        super()._fetch_loop()
        if self._store is not None:  # tell the server to stop, unless it is gone already
            with contextlib.suppress(RuntimeError):  # torch.distributed's DistError
                self._store.set(f"fetch/{self._next}", json.dumps({"close": True}))

    def _receive(self, request_id: str, source: str, num_blocks: int) -> torch.Tensor:
        if self._group is None:
            raise RuntimeError(f"not connected to the prefill engine at {self.config.address}: "
                               f"{self._connect_error}")
        if self._lost is not None:  # the link failed once: the peer's messages are out of step
            raise RuntimeError(f"the link to the prefill engine at {self.config.address} failed "
                               f"earlier: {self._lost}")
        n = self._next
        self._next += 1
        try:
            self._store.set(f"fetch/{n}", json.dumps({"request_id": request_id, "num_blocks": num_blocks}))
            reply = json.loads(self._store.get(f"reply/{n}"))
            self._store.delete_key(f"reply/{n}")
            if reply["error"] is None:
                data = self.caches.empty(num_blocks)
                self._group.recv([data], PREFILL, n % 2**31).wait()
        except Exception as err:  # a dead or stuck peer: fail the rest at once, not timeout_s each
            self._lost = err
            raise
        if reply["error"] is not None:
            raise RuntimeError(reply["error"])
        return data

    def close(self) -> None:
        super().close()  # the decode side's fetcher sends the server its close message
        if self.rank == PREFILL and self._store is not None and self._server is not None:
            # Its own connection: the server thread's wait holds the store client's socket.
            host, port = self.config.host_port
            with contextlib.suppress(RuntimeError):
                waker = dist.TCPStore(host, port, None, False, timedelta(seconds=5), wait_for_workers=False)
                waker.set(f"fetch/{self._next}", json.dumps({"close": True}))
            self._server.join(timeout=5)
