"""XLM-RoBERTa encoders (``XLMRobertaModel``: multilingual E5, BGE-M3's encoder) and their cross-encoder
head (``XLMRobertaForSequenceClassification``: bge-reranker): BERT's layers with RoBERTa's positions,
which start after the padding index."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.bert import BertModel


class XLMRobertaModel(BertModel):
    prefix = "roberta"

    @classmethod
    def max_positions(cls, config: PretrainedConfig) -> int:
        # Positions run from padding_idx + 1: the table's first rows are never a real token's.
        return int(config.max_position_embeddings) - int(config.pad_token_id) - 1

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.long()
        return torch.cumsum(mask, dim=1) * mask + int(self.config.pad_token_id)


class RobertaClassificationHead(nn.Module):
    """``out_proj(tanh(dense(first token)))``, named as in the checkpoints (``classifier.dense`` ...)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels or 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(hidden[:, 0])))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    is_classifier = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)
