"""BERT encoders (``BertModel``: all-MiniLM-L6-v2, BGE, E5, GTE) and the cross-encoder head
``BertForSequenceClassification``: bidirectional attention over whole inputs, no KV cache.

A batch is padded to its longest input: ``input_ids``, ``token_type_ids`` and ``attention_mask`` are
``[batch, length]``; the encoder returns the last hidden states ``[batch, length, hidden]``. Module and
parameter names are Hugging Face's, so a checkpoint loads by name (with or without the ``bert.`` prefix
that the task heads add).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.bert_packed import (
    PackedLayer,
    from_layout,
    layout,
    onednn_usable,
    pack_layers,
    packed_layers_forward,
    to_layout,
)

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str):  # type: ignore[no-untyped-def]
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported by the encoder models; supported: "
                         f"{', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, getattr(config, "type_vocab_size", 2)), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return out.transpose(1, 2).reshape(b, t, -1)


class BertDenseNorm(nn.Module):
    """``dense`` then the residual and ``LayerNorm``: BERT's attention output and its layer output."""

    def __init__(self, config: PretrainedConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    """The classification heads' pooler: ``tanh(dense(first token))``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """The encoder: token ids -> last hidden states. ``forward`` returns ``[batch, length, hidden]``."""

    # The prefix the task heads' checkpoints put before the encoder's weights.
    prefix = "bert"
    is_classifier = False
    # Whether one forward takes inputs of any lengths at little cost (the packed tokens of bert_packed.py):
    # the pooling runner then runs a step in one call rather than one per length group.
    packs_inputs = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self._packed: list[PackedLayer] | None = None  # built on the first forward (pack_layers)

    @classmethod
    def max_positions(cls, config: PretrainedConfig) -> int:
        """The longest input the position table holds."""
        return int(config.max_position_embeddings)

    def position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Positions 0, 1, ... of each row (padding sits at the end of a row)."""
        return torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """Right-padded rows in, the same shape out; computed over inputs grouped by length (bert_packed.py)."""
        groups = layout(attention_mask.sum(dim=1).tolist(), input_ids.device)
        x = self.embeddings(to_layout(input_ids, groups), to_layout(token_type_ids, groups),
                            to_layout(self.position_ids(attention_mask), groups))
        if self._packed is None:
            param = next(self.parameters())
            self._packed = pack_layers(self.encoder.layer, str(self.config.hidden_act),
                                       onednn_usable(param.dtype, param.device))
        x = packed_layers_forward(self._packed, x, groups)
        return from_layout(x, groups, *attention_mask.shape)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> BertModel:
        self._packed = None  # .to(), .float(), ...: the packed copies are of the old tensors
        return super()._apply(fn, *args, **kwargs)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no classification head: it embeds (--convert embed)")

    def _own_names(self, names: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names -> this module's: the task heads' ``bert.`` prefix dropped; the pooler of a
        plain encoder (sentence-transformers does not use it) and position-id buffers skipped."""
        own = dict(self.named_parameters())
        for name, tensor in names:
            if name.startswith(self.prefix + "."):
                name = name[len(self.prefix) + 1:]
            if name.endswith("position_ids") or (name.startswith("pooler.") and name not in own):
                continue
            # Checkpoints of old transformers versions name the LayerNorm weights gamma / beta.
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every parameter from the checkpoint; ValueError naming the ones it lacks or that do not fit."""
        self._packed = None
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in self._own_names(weights):
            if name not in params:
                continue  # heads this model does not run (e.g. a masked-LM head)
            p = params[name]
            if p.shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} in the checkpoint, "
                                 f"{tuple(p.shape)} in the model")
            p.data.copy_(tensor.to(p.dtype))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights of {type(self).__name__}: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, its pooler and ``classifier``; ``classify`` gives the logits."""

    is_classifier = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.pooler = BertPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels or 1)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch, length, hidden]`` -> logits ``[batch, num_labels]``."""
        return self.classifier(self.pooler(hidden))
