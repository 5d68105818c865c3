"""pagellm: a PagedAttention LLM inference engine in Python and PyTorch.

The public names are imported on first use, so that ``import pagellm.config`` (and the ``pagellm``
command's help) does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagellm.kernels.cpu_features import configure_torch_dispatch

# Before torch's oneDNN and ATen read their instruction-set caps: PAGELLM_HIDE_CPU_FEATURES hides
# features from them as from pagellm's own kernels.
configure_torch_dispatch()

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "EngineArgs": "pagellm.config",
    "BeamSearchParams": "pagellm.engine.beam_search",
    "BeamSearchOutput": "pagellm.engine.beam_search",
    "BeamSearchSequence": "pagellm.engine.beam_search",
    "SamplingParams": "pagellm.sampling_params",
    "StructuredOutputsParams": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "Logprob": "pagellm.outputs",
    "RequestMetrics": "pagellm.outputs",
    "PoolingRequestOutput": "pagellm.outputs",
    "EmbeddingRequestOutput": "pagellm.outputs",
    "ClassificationRequestOutput": "pagellm.outputs",
    "ScoringRequestOutput": "pagellm.outputs",
    "LoRARequest": "pagellm.lora.request",
}

__all__ = [
    "LLM", "LLMEngine", "EngineArgs", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "SamplingParams",
    "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "__version__",
    "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
    "LoRARequest",
]

if TYPE_CHECKING:
    from pagellm.config import EngineArgs
    from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.llm import LLM
    from pagellm.lora.request import LoRARequest
    from pagellm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestMetrics,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
