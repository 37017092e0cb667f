"""Two engines in one process: the fetcher copies the peer's blocks straight into its own
cache on its thread (tests; also a prefill and a decode engine sharing one host process)."""
from __future__ import annotations

import torch

from flagserve.engine.kv_transfer.transport import KVEndpoint


class InProcessTransport(KVEndpoint):
    def __init__(self, name: str, offer_timeout_s: float = 120.0):
        super().__init__(name, offer_timeout_s)
        self.peers: dict[str, InProcessTransport] = {}

    def _receive(self, request_id: str, source: str, num_blocks: int) -> torch.Tensor:
        peer = self.peers.get(source)
        if peer is None:
            raise RuntimeError(f"no in-process KV endpoint named {source!r} is connected")
        data, error = peer.serve(request_id, num_blocks)
        if error is not None:
            raise RuntimeError(error)
        return data


def inprocess_pair(offer_timeout_s: float = 120.0) -> tuple[InProcessTransport, InProcessTransport]:
    """(prefill endpoint, decode endpoint), connected both ways."""
    prefill = InProcessTransport("inproc-prefill", offer_timeout_s)
    decode = InProcessTransport("inproc-decode", offer_timeout_s)
    prefill.peers[decode.name], decode.peers[prefill.name] = decode, prefill
    return prefill, decode
