"""Nomic BERT encoders (``NomicBertModel``: nomic-embed-text-v1 / v1.5): BERT's post-norm layers with
rotary positions instead of a position table, a fused QKV projection and a SwiGLU MLP, without biases.

Both spellings of a checkpoint load: Nomic's own (``config.json``: ``n_embd``, ``n_head``, ``n_layer``,
``n_inner``, ``rotary_emb_base``; weights ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` / ``fc12`` / ``fc2``,
``norm1`` / ``norm2``, ``emb_ln``) and transformers' (``NomicBertConfig``; ``layers.N.self_attn.q_proj`` ...,
``mlp.up_proj`` / ``gate_proj`` / ``down_proj``, ``post_attention_layernorm`` / ``post_mlp_layernorm``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.bert import BertModel, activation
from pagellm.model.modernbert import rotary_attention

# Nomic's config key -> transformers' (a folder written by Nomic's remote code has only the former).
_CONFIG_KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
                "n_positions": "max_position_embeddings"}
# transformers' weight names -> Nomic's, which this module keeps (q/k/v are joined into Wqkv on load).
_RENAMES = [(r"^layers\.", "encoder.layers."), (r"\.self_attn\.o_proj\.", ".attn.out_proj."),
            (r"\.mlp\.up_proj\.", ".mlp.fc11."), (r"\.mlp\.gate_proj\.", ".mlp.fc12."),
            (r"\.mlp\.down_proj\.", ".mlp.fc2."), (r"\.post_attention_layernorm\.", ".norm1."),
            (r"\.post_mlp_layernorm\.", ".norm2."), (r"^embeddings\.LayerNorm\.", "emb_ln.")]
_QKV = re.compile(r"^(encoder\.layers\.\d+)\.self_attn\.([qkv])_proj\.weight$")


def setting(config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """``name`` (transformers' key) from Nomic's spelling where the folder has it, else transformers'."""
    for nomic, ours in _CONFIG_KEYS.items():
        if ours == name and getattr(config, nomic, None) is not None:
            return getattr(config, nomic)
    return getattr(config, name, default)


def rope_base(config: PretrainedConfig) -> float:
    if getattr(config, "rotary_emb_base", None) is not None:
        return float(config.rotary_emb_base)
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 1000.0)))


def check_nomic_config(config: PretrainedConfig) -> None:
    """ValueError naming a Nomic option pagellm does not implement."""
    unsupported = {"prenorm": True, "rotary_emb_interleaved": True, "parallel_block": True, "use_rms_norm": True,
                   "qkv_proj_bias": True, "mlp_fc1_bias": True, "mlp_fc2_bias": True}
    for key, bad in unsupported.items():
        if getattr(config, key, None) == bad:
            raise ValueError(f"NomicBertModel with {key}={bad} is not supported")
    if float(getattr(config, "rotary_emb_fraction", 1.0) or 1.0) != 1.0:
        raise ValueError("NomicBertModel with rotary_emb_fraction != 1 is not supported")
    if getattr(config, "rotary_scaling_factor", None):
        raise ValueError("NomicBertModel with rotary_scaling_factor (dynamic NTK) is not supported")
    act = str(getattr(config, "activation_function", "swiglu"))
    if act not in ("swiglu", "silu"):
        raise ValueError(f"NomicBertModel with activation_function {act!r} is not supported (swiglu)")


class NomicAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.out_proj(rotary_attention(self.Wqkv(x), mask, cos, sin, self.num_heads, self.head_dim))


class NomicMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.fc11 = nn.Linear(hidden, inner, bias=False)  # the value
        self.fc12 = nn.Linear(hidden, inner, bias=False)  # the gate
        self.fc2 = nn.Linear(inner, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc11(x) * self.act(self.fc12(x)))


class NomicLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float, act: str) -> None:
        super().__init__()
        self.attn = NomicAttention(hidden, heads)
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = NomicMLP(hidden, inner, act)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, mask, cos, sin))
        return self.norm2(x + self.mlp(x))


class NomicEncoder(nn.Module):
    def __init__(self, layers: list[NomicLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class NomicEmbeddings(nn.Module):
    def __init__(self, vocab: int, types: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.token_type_embeddings = nn.Embedding(max(1, types), hidden)


class NomicBertModel(BertModel):
    """The encoder; ``forward`` returns the last hidden states ``[batch, length, hidden]``."""

    prefix = "nomic_bert"
    packs_inputs = False

    def __init__(self, config: PretrainedConfig) -> None:
        nn.Module.__init__(self)  # not BERT's modules: Nomic's own
        check_nomic_config(config)
        self.config = config
        hidden, heads = int(setting(config, "hidden_size")), int(setting(config, "num_attention_heads"))
        inner, eps = int(setting(config, "intermediate_size")), float(setting(config, "layer_norm_eps", 1e-12))
        act = "silu" if str(getattr(config, "activation_function", "swiglu")) == "swiglu" else config.hidden_act
        self.embeddings = NomicEmbeddings(int(config.vocab_size), int(getattr(config, "type_vocab_size", 2)),
                                          hidden)  # type: ignore[assignment]
        self.emb_ln = nn.LayerNorm(hidden, eps=eps)
        self.encoder: NomicEncoder = NomicEncoder(  # type: ignore[assignment]
            [NomicLayer(hidden, heads, inner, eps, act) for _ in range(int(setting(config, "num_hidden_layers")))])
        head_dim = hidden // heads
        self.inv_freq = 1.0 / (rope_base(config) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    @classmethod
    def max_positions(cls, config: PretrainedConfig) -> int:
        return int(setting(config, "max_position_embeddings", 2048))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings
        x = self.emb_ln(emb.word_embeddings(input_ids) + emb.token_type_embeddings(token_type_ids))
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        freqs = pos[:, None].float() * self.inv_freq.to(input_ids.device)[None, :]
        rope = torch.cat((freqs, freqs), dim=-1)
        cos, sin = rope.cos().to(x.dtype), rope.sin().to(x.dtype)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layers:  # (an nn.ModuleList of NomicLayers)
            x = layer(x, mask, cos, sin)
        return x

    def _own_names(self, names: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Either spelling -> Nomic's; transformers' q, k and v projections joined into ``Wqkv``."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in names:
            for prefix in (self.prefix + ".", "bert."):
                name = name.removeprefix(prefix)
            for pattern, repl in _RENAMES:
                name = re.sub(pattern, repl, name)
            qkv = _QKV.match(name)
            if qkv:
                layer = parts.setdefault(qkv.group(1), {})
                layer[qkv.group(2)] = tensor
                if len(layer) == 3:
                    yield f"{qkv.group(1)}.attn.Wqkv.weight", torch.cat([layer["q"], layer["k"], layer["v"]])
                continue
            if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
                continue
            yield name, tensor
