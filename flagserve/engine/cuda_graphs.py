"""CUDA graphs of the decode forward, one per padded batch size, replayed on static buffers.

CUDA only: everywhere else the same padded forward runs eagerly (model_runner.py). Captured
after the KV cache exists (the graphs bind its addresses), largest size first into one memory
pool that the smaller graphs reuse; kv_budget.py reserves that pool before sizing the cache.
Every TP/PP worker captures the same sizes in the same order, so the collectives inside the
graphs pair up across TP ranks.
"""
from collections.abc import Callable, Iterable

import torch

Forward = Callable[[int], object]  # rows -> the forward's output tensors, read from static inputs


class DecodeGraphs:
    def __init__(self, forward: Forward, sizes: Iterable[int]):
        sizes = sorted(sizes, reverse=True)
        _warm_up(forward, sizes)
        pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        for rows in sizes:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[rows] = forward(rows)
            except RuntimeError as e:
                raise RuntimeError(f"capturing the decode CUDA graph of {rows} rows failed (an op "
                                   "that syncs with the host?); EngineArgs.enforce_eager=True "
                                   "runs without graphs") from e
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def __contains__(self, rows: int) -> bool:
        return rows in self.graphs

    def replay(self, rows: int) -> object:
        """The outputs of the graph of `rows` rows (the same tensors every replay)."""
        self.graphs[rows].replay()
        return self.outputs[rows]


def _warm_up(forward: Forward, sizes: list[int]) -> None:
    """Every size once outside any graph: Triton compiles per shape, cuBLAS picks its kernels
    and NCCL connects here, not during a capture; on a side stream, as torch.cuda.graph asks."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for rows in sizes:
            forward(rows)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
