"""FlagServe: Hydra-configured LLM serving on its own paged-attention engine.

The public names load lazily: `run.py stop` and the config checks must not pay for importing
torch and transformers.
"""
from importlib import import_module

_EXPORTS = {
    "LLM": "flagserve.entrypoints.llm",
    "LLMEngine": "flagserve.engine.llm_engine",
    "EngineArgs": "flagserve.engine.engine_args",
    "SamplingParams": "flagserve.engine.sampling_params",
    "RequestOutputKind": "flagserve.engine.sampling_params",
    "StructuredOutputsParams": "flagserve.engine.structured_outputs.params",
    "RequestOutput": "flagserve.engine.outputs",
    "CompletionOutput": "flagserve.engine.outputs",
    "Logprob": "flagserve.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flagserve' has no attribute {name!r}")
