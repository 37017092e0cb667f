"""Prefill/decode disaggregation at the engine level (issue 15's data path).

A prefill engine runs a request's prompt, samples its first token and parks its sequences;
`take_handoffs()` gives a RequestHandoff (plain data: tokens, sampling state, block layout)
and the KV blocks stay readable through a KVTransport until a decode engine fetches them. A
decode engine `import_request(handoff)`s it: blocks are allocated once they fit, the KV is
received into them on the transport's thread, and decoding continues as if it had prefilled.

handoff.py: what crosses the control path. config.py: the transfer's settings (EngineArgs).
cache_io.py: reading and writing blocks of the per-layer caches. transport.py: the interface
and the endpoint bookkeeping every transport shares; inproc.py (two engines, one process) and
p2p.py (torch.distributed gloo, or NCCL on GPU; any number of prefill and decode engines,
a pair per decode x prefill engine that exchange requests: p2p_pair.py). exports.py and
imports.py: each side's engine logic.
"""
