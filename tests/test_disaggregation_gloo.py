"""Prefill/decode disaggregation across two processes over torch.distributed gloo: the prefill
engine runs in a spawned child (rank 0, hosting the rendezvous store), the decode engine here;
handoffs travel by a queue (the control path), the KV by gloo."""
import multiprocessing as mp
import os
import queue
import time

import pytest
from test_disaggregation import BLOCKS, completions, reference, requests  # noqa: F401 - fixture

from flagserve import EngineArgs, LLMEngine
from tests.serve.conftest import free_port

TIMEOUT_S = 120


def kv_engine(path: str, role: str, address: str) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, dtype="float32", num_kv_blocks=BLOCKS, enforce_eager=True,
                                max_model_len=BLOCKS * 16,
                                kv_transfer={"role": role, "mode": "gloo", "address": address,
                                             "timeout_s": 30}))


def prefill_child(path: str, address: str, out: mp.Queue, control: mp.Queue, die: bool) -> None:
    """Hands off every request, then reports its free blocks once the transfers are done (or,
    with `die`, exits as soon as the parent says so, before serving anything)."""
    eng = kv_engine(path, "prefill", address)
    for r in requests():
        eng.add_prefill_request(*r)
    deadline = time.monotonic() + TIMEOUT_S
    while eng.has_unfinished() and time.monotonic() < deadline:
        if finished := [o for o in eng.step() if o.finished]:
            out.put(("outputs", finished))
        if handoffs := eng.take_handoffs():
            out.put(("handoffs", handoffs))
        if die and not eng.kv_exports.marked:
            control.get(timeout=TIMEOUT_S)
            os._exit(0)
    out.put(("free", (eng.block_manager.num_free_blocks, eng.has_unfinished())))
    control.get(timeout=TIMEOUT_S)
    eng.shutdown()


def run_pair(path: str, started: list, die: bool = False) -> tuple[dict, tuple | None, LLMEngine, mp.Process]:
    ctx = mp.get_context("spawn")
    out, control = ctx.Queue(), ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    child = ctx.Process(target=prefill_child, args=(path, address, out, control, die), daemon=True)
    child.start()
    started.append(child)
    decode = kv_engine(path, "decode", address)
    started.append(decode)
    got, free, handoffs = {}, None, []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < len(requests()) or (free is None and not die):
        assert time.monotonic() < deadline and (child.is_alive() or die), "the pair did not finish"
        try:
            kind, value = out.get(timeout=0.01)
        except queue.Empty:
            kind, value = None, None
        if kind == "outputs":
            got.update({o.request_id: o for o in value})
        elif kind == "handoffs":
            handoffs += value
        elif kind == "free":
            free = value
        if die and len(handoffs) + len(got) == len(requests()) and child.is_alive():
            # Once the two have met: a peer that never came up is the connect timeout's case.
            assert decode.kv_transport.connected.wait(TIMEOUT_S)
            control.put("die")  # the prefill process goes away before any KV is fetched
            child.join(TIMEOUT_S)
        if not die or not child.is_alive():
            for h in handoffs:
                decode.import_request(h)
            handoffs = []
        got.update({o.request_id: o for o in decode.step() if o.finished})
    control.put("stop")
    return got, free, decode, child


@pytest.fixture
def started():
    """What run_pair started: the child is killed whatever the test did."""
    things: list = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, LLMEngine):
            thing.shutdown()
            continue
        thing.join(10)
        if thing.is_alive():
            thing.kill()
            thing.join(5)


def test_two_processes_over_gloo_match_aggregated(llama_path, reference, started):  # noqa: F811
    got, free, decode, child = run_pair(llama_path, started)
    for rid, ref in reference.items():
        assert completions(got[rid]) == completions(ref), rid
    assert free == (BLOCKS, False)  # the prefill side freed every block after its transfers
    assert decode.block_manager.num_free_blocks == BLOCKS
    assert decode.kv_transport.stats.requests_received == len(reference) - 1  # "one" ended in prefill
    child.join(30)
    assert child.exitcode == 0


def test_prefill_process_gone_fails_its_requests_without_hanging(llama_path, started):
    got, _, decode, _ = run_pair(llama_path, started, die=True)
    transferred = [r for r, o in got.items() if o.error is not None]
    assert len(transferred) == len(requests()) - 1  # all but "one", which ended in prefill
    assert all(got[r].outputs[0].finish_reason == "abort" for r in transferred)
    assert decode.block_manager.num_free_blocks == BLOCKS


@pytest.mark.parametrize("role,peer", [("prefill", "decode"), ("decode", "prefill")])
def test_waiting_for_a_peer_that_never_comes_fails_with_why(role, peer):
    """wait_connected (what a server sets): the engine fails to start after connect_timeout_s
    instead of serving requests that would wait for a link."""
    from flagserve.engine.kv_transfer.config import KVTransferConfig
    from flagserve.engine.kv_transfer.p2p import P2PTransport
    config = KVTransferConfig(role, "gloo", f"127.0.0.1:{free_port()}", connect_timeout_s=2,
                              wait_connected=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"no {peer} engine connected to the KV endpoint .* within 2 s"):
        P2PTransport(config, cuda=False).bind(None)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(("mode", "gpu", "peer_gpu", "expected"), [
    ("nccl", "GPU-a", "GPU-b", "nccl"),  # two GPUs: NCCL
    ("nccl", "GPU-a", "GPU-a", "gloo"),  # one GPU: NCCL cannot connect two ranks on it
    ("gloo", "GPU-a", "GPU-b", "gloo"),  # asked for
    ("gloo", None, None, "gloo"),  # CPU engines
])
def test_a_pair_on_one_gpu_goes_over_gloo(mode, gpu, peer_gpu, expected):
    from flagserve.engine.kv_transfer.p2p_pair import pair_mode

    assert pair_mode(mode, gpu, peer_gpu) == expected
    assert pair_mode(mode, peer_gpu, gpu) == expected  # both sides agree
