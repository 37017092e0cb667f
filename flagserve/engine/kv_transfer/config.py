"""Settings of a KV transfer endpoint, carried in EngineArgs.kv_transfer (plain data, so it
reaches an engine in its own process)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Which side of a point-to-point link this engine is: the prefill side hosts the rendezvous
# store and serves its KV; the decode side connects to each prefill engine it fetches from.
KVRole = Literal["prefill", "decode"]
# auto: NCCL when the engine's KV cache is on CUDA, else gloo (TCP, CPU tensors). Either way a
# pair of engines on one GPU uses gloo through host memory (p2p_pair.pair_mode).
KVTransferMode = Literal["auto", "gloo", "nccl"]


@dataclass
class KVTransferConfig:
    role: KVRole
    mode: KVTransferMode = "auto"
    # prefill: host:port its rendezvous store binds (port 0: any free port), the host as the
    # decode engines reach it. decode: a prefill engine to connect to at start, or None (it
    # connects to each prefill engine named by a handoff's `source` on first use).
    address: str | None = "127.0.0.1:29650"
    timeout_s: float = 60.0  # a fetch waiting longer for its reply or data fails
    # A prefill engine frees KV no decode engine fetched within this long (a decode replica
    # died, or aborted before fetching): blocks never leak.
    offer_timeout_s: float = 120.0
    # How long the two sides wait for each other at start (the peer may be loading weights).
    connect_timeout_s: float = 600.0
    # True: the engine's construction waits for a peer (prefill: any decode engine; decode:
    # the one at `address`), up to connect_timeout_s, and fails if none comes. False: links
    # come up in the background, or on first use.
    wait_connected: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"EngineArgs.kv_transfer.{name} {message}")

        check(self.role in get_args(KVRole), "role", f"must be one of {get_args(KVRole)}, got {self.role!r}")
        check(self.mode in get_args(KVTransferMode), "mode",
              f"must be one of {get_args(KVTransferMode)}, got {self.mode!r}")
        if self.address is not None or self.role == "prefill":
            host, _, port = str(self.address).rpartition(":")
            check(bool(host) and port.isdigit() and 0 <= int(port) < 65536, "address",
                  f"must be host:port, got {self.address!r}")
        for name in ("timeout_s", "offer_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and value > 0, name, f"must be > 0, got {value!r}")

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)

    def resolved_mode(self, cuda: bool) -> Literal["gloo", "nccl"]:
        if self.mode == "auto":
            return "nccl" if cuda else "gloo"
        return self.mode
