"""Engine counters and gauges, read by the metrics endpoint and the benchmarks."""
from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued: new or preempted, awaiting a grammar or imported KV
    kv_cache_usage: float  # share of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of those, tokens found (cumulative)
    prompt_tokens: int  # cumulative
    generation_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    num_steps: int
    step_seconds: float  # wall time inside step(), cumulative
    forward_seconds: float  # of which model forward + LM head
    structured_output_compile_requests: int = 0  # grammars asked of the compiler (cumulative)
    structured_output_cache_hits: int = 0  # of those, found compiled (or compiling) in its LRU
    # KV transfer of a prefill or decode engine (kv_transfer/transport.py TransferStats)
    kv_sent_bytes: int = 0
    kv_received_bytes: int = 0
    kv_sent_requests: int = 0
    kv_received_requests: int = 0
    kv_transfer_failures: int = 0  # either side: fetches failed, offers expired or unreadable
    kv_receive_seconds: float = 0.0  # decode side: from a fetch's start to its KV in place
    queued_prompt_tokens: int = 0  # prompt tokens not yet computed (a prefill role scales on it)
