"""ModernBERT encoders (``ModernBertModel``: gte-modernbert, nomic-embed-text-v2's base, ModernBERT-embed):
pre-norm layers without biases, rotary positions (one base for the global layers, another for the local
ones), a GeGLU MLP, and local layers that see only the tokens within ``local_attention // 2`` of each
token (both sides); every ``global_attn_every_n_layers``-th layer sees the whole input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.bert import BertModel, activation


def _norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=bool(config.norm_bias))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_attention(qkv: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, head_dim: int) -> torch.Tensor:
    """Bidirectional attention over fused projections with rotary positions (ModernBERT, NomicBERT).
    qkv: [b, t, 3 * num_heads * head_dim] -> [b, t, num_heads * head_dim]."""
    b, t, _ = qkv.shape
    q, k, v = qkv.view(b, t, 3, num_heads, head_dim).unbind(dim=2)
    q, k, v = (y.transpose(1, 2) for y in (q, k, v))
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5)
    return out.transpose(1, 2).reshape(b, t, -1)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=bool(config.attention_bias))
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=bool(config.attention_bias))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.Wo(rotary_attention(self.Wqkv(x), mask, cos, sin, self.num_heads, self.head_dim))


class ModernBertMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bool(config.mlp_bias))
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=bool(config.mlp_bias))
        self.act = activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)
        self.attn = ModernBertAttention(config)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def layer_types(config: PretrainedConfig) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    every = int(getattr(config, "global_attn_every_n_layers", 3))
    return ["sliding_attention" if i % every else "full_attention" for i in range(config.num_hidden_layers)]


def rope_theta(config: PretrainedConfig, layer_type: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and "rope_theta" in params[layer_type]:
        return float(params[layer_type]["rope_theta"])
    key = "global_rope_theta" if layer_type == "full_attention" else "local_rope_theta"
    return float(getattr(config, key, 160000.0 if layer_type == "full_attention" else 10000.0))


class ModernBertModel(BertModel):
    """The encoder; ``token_type_ids`` are ignored (ModernBERT has none)."""

    prefix = "model"
    packs_inputs = False

    def __init__(self, config: PretrainedConfig) -> None:
        nn.Module.__init__(self)  # not BERT's modules: ModernBERT's own
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)  # type: ignore[assignment]
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)
        self.layer_types = layer_types(config)
        self.window = int(config.local_attention) // 2
        head_dim = config.hidden_size // config.num_attention_heads
        self.inv_freq = {t: 1.0 / (rope_theta(config, t) ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                                              / head_dim))
                         for t in set(self.layer_types)}

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        keys = attention_mask.bool()[:, None, None, :]
        masks = {"full_attention": keys,
                 "sliding_attention": keys & ((pos[:, None] - pos[None, :]).abs() <= self.window)[None, None]}
        rope = {}
        for kind, inv in self.inv_freq.items():
            freqs = pos[:, None].float() * inv.to(input_ids.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            rope[kind] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for layer, kind in zip(self.layers, self.layer_types):
            x = layer(x, masks[kind], *rope[kind])
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=bool(config.classifier_bias))
        self.act = activation(config.classifier_activation)
        self.norm = _norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(ModernBertModel):
    """A ModernBERT cross-encoder: the first token or the mean (``classifier_pooling``), ``head``, then
    ``classifier``."""

    is_classifier = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.head = ModernBertPredictionHead(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels or 1)
        self.pooling = str(getattr(config, "classifier_pooling", "cls"))
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {self.pooling!r} is not supported (cls or mean)")

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1)
        return self.classifier(self.head(pooled))
