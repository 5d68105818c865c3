"""pagellm: a PagedAttention LLM inference engine in Python and PyTorch."""

from pagellm.config import EngineArgs
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "__version__",
]
