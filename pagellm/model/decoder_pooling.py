"""Decoder models on the pooling runner (``--runner pooling --convert embed|classify``): a Llama-family
model's layers run over whole inputs with causal attention and no KV cache, as vLLM's ``as_embedding_model``
and ``as_seq_cls_model`` adapters run them.

- embed: the final (normed) hidden states, pooled as sentence-transformers' files say (Qwen3-Embedding:
  last token + normalize; vLLM's default for decoders where there are none).
- classify: a ``score`` head over the last token's hidden state. It is the checkpoint's
  (``Qwen3ForSequenceClassification``: ``score.weight``), or built from the LM head's rows of the tokens
  ``classifier_from_token`` names (``--hf-overrides``, vLLM's keys): with two tokens and
  ``is_original_qwen3_reranker`` (or ``method: from_2_way_softmax``), one logit ``yes - no``, so that the
  sigmoid of it is the softmax over (no, yes) of the original Qwen3-Reranker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagellm.model import loader
from pagellm.model.llama import DecoderLayer, LlamaForCausalLM, sliding_window_of
from pagellm.model.registry import MODEL_REGISTRY

# A sequence-classification architecture -> the causal LM whose layers it runs.
DECODER_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
# The names a checkpoint saved from the bare decoder (AutoModel: Qwen3-Embedding) gives its weights.
_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def is_decoder_architecture(architectures: list[str]) -> bool:
    """Whether the pooling runner can run these architectures as a decoder."""
    return any(a in DECODER_CLASSIFIERS or a in MODEL_REGISTRY for a in architectures)


def is_decoder_classifier(config: PretrainedConfig) -> bool:
    """A score head: a ``*ForSequenceClassification`` checkpoint, or one built from ``classifier_from_token``."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(getattr(config, "classifier_from_token", None)) or any(a in DECODER_CLASSIFIERS for a in archs)


def _causal_lm_config(config: PretrainedConfig) -> PretrainedConfig:
    base = deepcopy(config)
    archs = list(getattr(config, "architectures", None) or [])
    base.architectures = [DECODER_CLASSIFIERS.get(a, a) for a in archs]
    return base


class DecoderPoolingModel(nn.Module):
    """The pooling runner's interface (``forward(ids, types, mask)`` -> ``[batch, length, hidden]``,
    ``classify``) over a ``LlamaForCausalLM``'s layers."""

    def __init__(self, lm: LlamaForCausalLM, config: PretrainedConfig, score: nn.Linear | None) -> None:
        super().__init__()
        self.lm = lm
        self.config = config
        self.score = score
        self.is_classifier = score is not None
        odd = {type(layer).__name__ for layer in lm.layers if type(layer) is not DecoderLayer}
        if odd:
            raise ValueError(f"--runner pooling runs decoders of the Llama / Mistral / Qwen2 / Qwen3 layers; "
                             f"{', '.join(config.architectures or [])} has {', '.join(sorted(odd))}")

    @classmethod
    def max_positions(cls, config: PretrainedConfig) -> int:
        """The longest input: the position limit, or the sliding window where one applies to every layer
        (whole inputs are attended without it)."""
        window = sliding_window_of(config)
        limit = int(getattr(config, "max_position_embeddings", 2048))
        return min(limit, int(window)) if window else limit

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """Right-padded rows: causal attention keeps each real token from seeing the padding after it."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).repeat(b)
        x = self.lm.embed(input_ids.reshape(-1))
        residual: torch.Tensor | None = None
        for module in self.lm.layers:
            layer = cast(DecoderLayer, module)
            if residual is None:
                residual, h = x, layer.input_layernorm(x)
            else:
                h, residual = layer.input_layernorm(x, residual)
            attn = layer.self_attn
            q, k, v = attn.project_qkv(positions, h)
            q, k, v = (y.view(b, t, y.shape[1], y.shape[2]).transpose(1, 2) for y in (q, k, v))
            if k.shape[1] != q.shape[1]:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
            h = attn.o_proj(o.transpose(1, 2).reshape(b * t, attn.q_size))
            h, residual = layer.post_attention_layernorm(h, residual)
            x = layer.mlp(h)
        assert residual is not None
        return self.lm.norm(x, residual)[0].view(b, t, -1)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The score head over each row's last real token: logits ``[batch, num_labels]``."""
        if self.score is None:
            raise ValueError("this decoder has no score head: it embeds (--convert embed); a reranker needs "
                             "a *ForSequenceClassification checkpoint or --hf-overrides' classifier_from_token")
        last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.score(rows.to(self.score.weight.dtype))


def _renamed(weights: Iterable[tuple[str, Any]], score: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
    """Checkpoint names as ``LlamaForCausalLM`` reads them: the bare decoder's gain ``model.``; the score
    head's are kept aside in ``score``."""
    for name, tensor in weights:
        if name.startswith("score."):
            score[name.removeprefix("score.")] = tensor
            continue
        if name.startswith(_BARE_PREFIXES):
            name = "model." + name
        yield name, tensor


def _token_rows(tokenizer: Any, tokens: list[Any]) -> list[int]:
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else int(token)
        if tid is None or (isinstance(token, str) and tid == getattr(tokenizer, "unk_token_id", None)):
            raise ValueError(f"classifier_from_token: {token!r} is not one token of this model's vocabulary")
        ids.append(int(tid))
    return ids


def load_decoder_pooler(folder: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                        tokenizer: Any, classify: bool, load_format: str = "auto") -> DecoderPoolingModel:
    """The decoder with its weights, and its score head where ``classify``."""
    base = _causal_lm_config(config)
    from_tokens = list(getattr(config, "classifier_from_token", None) or [])
    # Without the LM head's rows to read, the head is tied (never computed): a checkpoint of the bare
    # decoder or of a classifier has none.
    if not from_tokens:
        base.tie_word_embeddings = True
    score_weights: dict[str, torch.Tensor] = {}
    files = loader.resolve_model_files(folder)
    lm = loader.load_model(files, base, dtype, device, load_format, DecoderPoolingModel.max_positions(base),
                           rename=lambda weights: _renamed(weights, score_weights))
    score = None
    if classify:
        score = _score_head(config, lm, score_weights, tokenizer, dtype, device, load_format)
    if from_tokens:
        lm.lm_head = nn.Linear(1, 1, bias=False)  # its rows are in the score head now
    return DecoderPoolingModel(lm, config, score).eval()


def _score_head(config: PretrainedConfig, lm: LlamaForCausalLM, weights: dict[str, torch.Tensor], tokenizer: Any,
                dtype: torch.dtype, device: torch.device, load_format: str) -> nn.Linear:
    hidden = int(config.hidden_size)
    from_tokens = list(getattr(config, "classifier_from_token", None) or [])
    if from_tokens:
        rows = lm.lm_head.weight.detach()[_token_rows(tokenizer, from_tokens)].float()
        method = getattr(config, "method", None)
        if len(rows) == 2 and (getattr(config, "is_original_qwen3_reranker", False) or method == "from_2_way_softmax"):
            weight = (rows[1] - rows[0]).unsqueeze(0)  # sigmoid(yes - no) = softmax(no, yes)[yes]
        else:
            weight = rows
    elif "weight" in weights:
        weight = weights["weight"].float()
    elif load_format == "dummy":
        weight = torch.randn(int(getattr(config, "num_labels", 1) or 1), hidden) * 0.02
    else:
        raise ValueError(f"{', '.join(config.architectures or [])}: the checkpoint has no score.weight; a decoder "
                         "reranker needs a *ForSequenceClassification checkpoint, or --hf-overrides "
                         """'{"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'""")
    bias = weights.get("bias")
    head = nn.Linear(hidden, weight.shape[0], bias=bias is not None, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight.to(dtype))
        if bias is not None and head.bias is not None:
            head.bias.copy_(bias.to(dtype))
    config.num_labels = int(weight.shape[0])
    return head
