"""One prefill <-> decode pair of the point-to-point transport (p2p.py): what the two share in
the prefill endpoint's TCPStore, and each side's end of it.

    peers                a counter: a decode endpoint that joins takes the next pair index k
    gpu                  the prefill engine's GPU (its UUID), or none
    hello/<k>            it announces itself and its GPU; the prefill side starts a PairServer
                         for k
    peer/<k>/fetch/<n>   {request_id, num_blocks}: the decode side asks for a request's KV
    peer/<k>/reply/<n>   {error}; without one the KV follows as one tensor tagged n over the
                         pair's own two-rank process group (never the default group, so TP/PP
                         groups are untouched)

Each pair picks its own transport from the endpoints' mode and the two GPUs (pair_mode): NCCL
cannot connect two ranks on one GPU, so a pair on the same GPU (1P1D on one GPU) goes over
gloo, staged through host memory.

A pair lives as long as its link: a decode side whose fetch failed drops it and joins again as
a new pair on its next fetch, so a restarted peer never leaves the survivors out of step.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
IDLE_WAIT_S = 3600.0  # a server's wait for its next message; each timeout just waits again
PREFILL, DECODE = 0, 1


def gpu_id(device: torch.device | None) -> str | None:
    """The UUID of a CUDA device (what identifies it across processes), else None."""
    if device is None or device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def pair_mode(mode: str, gpu: str | None, peer_gpu: str | None) -> str:
    """The transport of one pair; both sides compute it from the same three values."""
    return "gloo" if mode == "nccl" and gpu is not None and gpu == peer_gpu else mode


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A connection of its own: a blocking wait holds a TCPStore client's socket."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_group(store: dist.Store, rank: int, mode: str, timeout: timedelta,
               local_host: str) -> dist.ProcessGroup:
    if mode == "nccl":  # CUDA only (its own default timeout): cannot run on CPU-only machines
        return dist.ProcessGroupNCCL(store, rank, 2)
    options = dist.ProcessGroupGloo._Options()  # noqa: SLF001 - torch's only way to pick a device
    options._timeout = timeout  # noqa: SLF001
    # The interface that reaches the peer: hosts in network namespaces share a host name, so
    # gloo's default (the host name's address) may be one the peer cannot reach.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]  # noqa: SLF001
    return dist.ProcessGroupGloo(store, rank, 2, options)


def local_address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class PairServer:
    """Prefill side of pair k: answers its decode peer's fetches in order, on a thread."""

    def __init__(self, k: int, address: tuple[str, int], mode: str, timeout_s: float,
                 serve: Callable[[str, int], tuple[torch.Tensor | None, str | None]],
                 on_connected: Callable[[], None], device: torch.device | None):
        self.k, self.address, self.mode, self.timeout_s = k, address, mode, timeout_s
        self.serve, self.on_connected, self.device = serve, on_connected, device
        self.next = 0  # the decode side numbers the fetches, both count
        self.thread = threading.Thread(target=self._run, name=f"kv-serve-{k}", daemon=True)

    def _run(self) -> None:
        try:
            if self.mode == "nccl":
                torch.cuda.set_device(self.device)
            store = dist.PrefixStore(f"peer/{self.k}", store_client(*self.address, self.timeout_s))
            group = make_group(dist.PrefixStore("group", store), PREFILL, self.mode,
                               timedelta(seconds=self.timeout_s), self.address[0])
            self.on_connected()
            self._serve(store, group)
        except Exception as err:  # noqa: BLE001 - the peer fails its fetch and joins anew
            log.warning("KV transfer: pair %d with a decode engine ended: %s", self.k, err)

    def _serve(self, store: dist.Store, group: dist.ProcessGroup) -> None:
        while True:
            key = f"fetch/{self.next}"
            try:
                store.wait([key], timedelta(seconds=IDLE_WAIT_S))
            except dist.DistStoreError:
                continue  # idle
            message = json.loads(store.get(key))
            store.delete_key(key)
            if message.get("close"):
                return
            data, error = self.serve(message["request_id"], message["num_blocks"])
            store.set(f"reply/{self.next}", json.dumps({"error": error}))
            if data is not None:  # a failure ends the pair: its messages are out of step
                staged = data if self.mode == "nccl" else data.cpu()  # gloo sends host memory
                group.send([staged], DECODE, self.next % 2**31).wait()
            self.next += 1

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # torch.distributed's DistError: gone already
            waker = store_client(*self.address, 5)
            waker.set(f"peer/{self.k}/fetch/{self.next}", json.dumps({"close": True}))


class PairLink:
    """Decode side of a pair: joins the prefill endpoint at `address`, then fetches one request
    after another (on the caller's thread: the endpoint's fetcher of that source)."""

    def __init__(self, address: tuple[str, int], mode: str, timeout_s: float,
                 connect_timeout_s: float, device: torch.device | None):
        client = store_client(*address, connect_timeout_s)
        gpu = gpu_id(device)
        self.mode = mode = pair_mode(mode, gpu, json.loads(client.get("gpu"))["gpu"])
        if mode == "nccl":
            torch.cuda.set_device(device)
        self.k = client.add("peers", 1) - 1
        client.set(f"hello/{self.k}", json.dumps({"gpu": gpu}))
        self.store = dist.PrefixStore(f"peer/{self.k}", client)
        self.group = make_group(dist.PrefixStore("group", self.store), DECODE, mode,
                                timedelta(seconds=timeout_s), local_address_towards(address[0]))
        client.set_timeout(timedelta(seconds=timeout_s))
        self.next = 0

    def receive(self, request_id: str, empty: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
        """The request's KV into `empty`, or the prefill side's error (the link stays good).
        Raises if the link itself failed."""
        n = self.next
        self.next += 1
        self.store.set(f"fetch/{n}", json.dumps({"request_id": request_id,
                                                 "num_blocks": empty.shape[2]}))
        reply = json.loads(self.store.get(f"reply/{n}"))
        self.store.delete_key(f"reply/{n}")
        if reply["error"] is not None:
            return None, reply["error"]
        # gloo receives into host memory: a fresh buffer, not a copy of `empty`'s contents
        staged = empty if self.mode == "nccl" or not empty.is_cuda else torch.empty_like(empty, device="cpu")
        self.group.recv([staged], PREFILL, n % 2**31).wait()
        if staged is not empty:
            empty.copy_(staged)
        return empty, None

    def close(self) -> None:
        """Ends the peer's server (unless it is gone already)."""
        with contextlib.suppress(RuntimeError):
            self.store.set(f"fetch/{self.next}", json.dumps({"close": True}))
