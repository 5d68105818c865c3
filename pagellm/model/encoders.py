"""Encoder architectures (bidirectional attention, no KV cache: the pooling runner's models) and their
loading from a Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from pagellm.model.bert import BertForSequenceClassification, BertModel
from pagellm.model.loader import iterate_weights
from pagellm.model.modernbert import ModernBertForSequenceClassification, ModernBertModel
from pagellm.model.nomic_bert import NomicBertModel
from pagellm.model.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

ENCODER_REGISTRY: dict[str, type[BertModel]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "NomicBertModel": NomicBertModel,
    # Masked-LM checkpoints hold the whole encoder; their LM head is left unread.
    "BertForMaskedLM": BertModel,
    "XLMRobertaForMaskedLM": XLMRobertaModel,
    "ModernBertForMaskedLM": ModernBertModel,
    "NomicBertForMaskedLM": NomicBertModel,
}


def folder_architectures(folder: Path) -> list[str]:
    """config.json's ``architectures`` (read as JSON: no transformers), or [] where there is none."""
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    return [str(a) for a in archs]


def is_encoder_folder(folder: Path) -> bool:
    return any(a in ENCODER_REGISTRY for a in folder_architectures(folder))


def encoder_class_for(architectures: list[str] | None) -> type[BertModel]:
    for arch in architectures or []:
        if arch in ENCODER_REGISTRY:
            return ENCODER_REGISTRY[arch]
    raise ValueError(
        f"architecture {architectures or '(none given in config.json)'} cannot run with --runner pooling; "
        f"pagellm's pooling models: {', '.join(sorted(ENCODER_REGISTRY))}"
    )


def load_encoder(folder: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                 load_format: str = "auto", seed: int = 0) -> BertModel:
    """The encoder with its weights (``load_format="dummy"``: random ones)."""
    cls = encoder_class_for(getattr(config, "architectures", None))
    with torch.device(device):
        model = cls(config)
    model.to(dtype)
    if load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name.lower():
                    p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02).to(p.dtype))
    else:
        with torch.no_grad():
            model.load_weights(iterate_weights(folder))
    return model.eval()
