"""Architecture name (``config.architectures[0]``) -> model class."""

from __future__ import annotations

from pagellm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from pagellm.model.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def model_class_for(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """The class that implements the first supported name; ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given in config.json)'}; "
        f"pagellm supports: {', '.join(sorted(MODEL_REGISTRY))} (encoders such as BertModel run with --runner pooling)"
    )
