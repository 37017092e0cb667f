"""FlagServe: Hydra-configured LLM serving on its own paged-attention engine."""
from flagserve.engine.engine_args import EngineArgs
from flagserve.engine.llm_engine import LLMEngine
from flagserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from flagserve.engine.sampling_params import RequestOutputKind, SamplingParams
from flagserve.entrypoints.llm import LLM

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob"]
