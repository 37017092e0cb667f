"""The step-loop runtime: LLMEngine.step() in a loop (loop.py), and where that loop runs.

Why a child process (`engine_core: process`, the default with TP = PP = 1; vLLM V1's
EngineCore in small): in one process the step loop and the replica's event loop (HTTP, SSE,
Ray Serve) share the GIL, which every torch op releases and retakes, so a busy event loop
stretches every step (figures: docs/performance.md, "Serving"). In its own process the loop
steps at full speed and the replica gets one message per step (wire.py).
`engine_core: thread` (what TP x PP > 1 uses) keeps the loop on a thread of the replica,
which then drives its shard workers itself.

    interface.py  EngineCore, the one interface of both; make_core picks one
    thread.py     EngineThread: run_steps on a thread of this process
    process.py    EngineProcess: run_steps in a child process, over a socketpair
    wire.py       StepResult <-> plain tuples, the child's one message per step
"""
