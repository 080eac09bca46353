"""conveyor: a continuous-batching LLM inference engine in plain PyTorch."""

from conveyor.engine_args import EngineArgs
from conveyor.entrypoints.beam_search import BeamSearchParams
from conveyor.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from conveyor.pooling_params import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.structured.params import StructuredOutputs

__all__ = [
    "AsyncLLM",
    "BeamSearchParams",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputs",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "Logprob",
    "PoolingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the engine pulls in torch and transformers.
    if name == "LLM":
        from conveyor.entrypoints.llm import LLM

        return LLM
    if name in ("AsyncLLM", "AsyncLLMEngine"):
        from conveyor.entrypoints import async_llm

        return getattr(async_llm, name)
    if name == "LLMEngine":
        from conveyor.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
