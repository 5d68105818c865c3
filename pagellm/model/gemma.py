"""The Gemma2 and Gemma3 (text) families on the Llama pieces (llama.py).

What differs from Llama, as transformers' modeling_gemma2.py and modeling_gemma3.py compute it:

- the embeddings are multiplied by sqrt(hidden_size), that factor rounded to the model's dtype;
- RMSNorm scales by ``1 + weight``, in float32, and rounds once at the end (``GemmaRMSNorm``);
- four norms per layer: before attention, on the attention output (before the residual addition),
  before the MLP and on its output;
- the MLP's activation is gelu with the tanh approximation;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window and full-attention layers alternate (``config.layer_types``): each layer hands its
  own window to the attention backend, and reads its KV cache group's block tables (``kv_groups_of``:
  the engine gives each kind of layer a pool and tables of its own, so that the blocks that fall out
  of the sliding layers' window can be freed);
- Gemma2 soft-caps the attention scores (so it runs on the PyTorch backend, the native kernels have
  no soft-capping) and the final logits: ``tanh(x / cap) * cap``;
- Gemma3 normalizes each query and key head (``q_norm``, ``k_norm``, Gemma-style) before the
  rotation, and its sliding layers rotate with their own rope parameters (transformers 5 keeps one set
  per layer type in ``config.rope_parameters``).
"""

from __future__ import annotations

from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.attention import AttentionMetadata, KVCache, OutputRows
from pagellm.model.attention.torch_backend import soft_cap
from pagellm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagellm.model.llama import PER_LAYER_WINDOW_TYPES, Attention, LlamaForCausalLM, head_dim_of
from pagellm.model.quant_linear import QuantLinear

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")  # transformers' names of the tanh approximation


class GemmaRMSNorm(RMSNorm):
    """RMSNorm that scales by ``1 + weight`` in float32 and rounds once to the input's dtype (Llama's
    rounds the normalized input first, then scales: other bits in bfloat16)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)  # the identity scale, as transformers starts it (and dummy weights keep it)

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with the residual stream, (norm(x + residual), x + residual)."""
        if residual is None:
            return self.reference(x)
        total = x + residual
        return self.reference(total), total

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeluMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul."""

    # The native packed linear applies silu(gate) * up, not gelu: no projection of this MLP is packed gated.
    gated_projection = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (num_tokens, intermediate) each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's score scale, this layer's own window and, for Gemma3, Gemma-style
    per-head q/k norms."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, window: int | None, qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.window = window  # None: this layer attends to the whole context
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, window: int | None, qk_norm: bool,
                 kv_group: int = 0) -> None:
        super().__init__()
        # The KV cache group whose block tables and slots this layer reads (kv_groups_of).
        self.kv_group = kv_group
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, rotary, window, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeluMLP(hidden, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
        meta: AttentionMetadata, keep: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``llama.DecoderLayer.forward``: x is the previous layer's output (normed MLP output; the
        embeddings for the first layer, residual None), residual the running sum before it. Returns
        (this layer's normed MLP output, the running sum before it), for ``keep``'s rows where given."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.kv_group:
            meta = meta.for_group(self.kv_group)
            keep = keep.for_group(self.kv_group) if keep is not None else None
        h = self.self_attn(positions, h, kv_cache, meta, keep)  # (num_kept, hidden)
        if keep is not None:
            residual = residual[keep.index]
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class _LayerTypeConfig:
    """A config as the layers of one type see it: that type's own rope parameters (what
    ``RotaryEmbedding`` and transformers' rope functions read), every other attribute the config's."""

    def __init__(self, config: PretrainedConfig, rope_parameters: dict) -> None:
        self._config = config
        self.rope_parameters = rope_parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def rope_config_for(config: PretrainedConfig, layer_type: str) -> PretrainedConfig:
    """The config whose rope parameters are ``layer_type``'s: Gemma3 keeps one set per layer type
    (``{"sliding_attention": {...}, "full_attention": {...}}``), Gemma2 one for all."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        # (A view, read as the config it wraps by the rotary embedding and transformers' rope functions.)
        return cast(PretrainedConfig, _LayerTypeConfig(config, params[layer_type]))
    return config


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """Each layer's kind, sliding or full attention; ValueError for any other."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types must name the kind of each of the {config.num_hidden_layers} "
                         f"layers, got {types}")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported (only {SLIDING!r} and {FULL!r})")
    return types


def kv_groups_of(config: PretrainedConfig) -> list[tuple[int | None, tuple[int, ...]]] | None:
    """The layers grouped by how they attend, as (window or None for full attention, layer indices):
    the full-attention group first, then the sliding one. None where one group serves every layer
    (every layer attends alike, or no window is set)."""
    if getattr(config, "model_type", "") not in PER_LAYER_WINDOW_TYPES:
        return None
    types = layer_types_of(config)
    window = getattr(config, "sliding_window", None) or None
    full = tuple(i for i, t in enumerate(types) if t == FULL)
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING)
    if window is None or not full or not sliding:
        return None
    return [(None, full), (window, sliding)]


def rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (via float32, as transformers stores it in a float32 buffer)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2 / Gemma3 text decoder (see the module docstring); subclasses set ``qk_norm``."""

    native_step_driver = False  # (the native step driver runs Llama layers only)
    qk_norm = False  # Gemma3: per-head q/k norms

    def __init__(self, config: PretrainedConfig, max_position: int) -> None:
        super().__init__(config, max_position)
        self.attn_logit_softcap = getattr(config, "attn_logit_softcapping", None)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported (only {', '.join(GELU_TANH)})")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (pagellm's attention is causal)")
        layer_types_of(config)

    def make_layers(self, config: PretrainedConfig, max_position: int) -> list[nn.Module]:
        types = layer_types_of(config)
        # One rotary table per layer type, shared by the layers of that type.
        rotary = {t: RotaryEmbedding(rope_config_for(config, t), head_dim_of(config), max_position) for t in set(types)}
        window = getattr(config, "sliding_window", None) or None
        groups = kv_groups_of(config)
        # Where the KV cache is split by attention kind, the sliding layers read group 1's tables.
        return [GemmaDecoderLayer(config, rotary[t], window if t == SLIDING else None, self.qk_norm,
                                  kv_group=int(groups is not None and t == SLIDING)) for t in types]

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        return x * rounded_to(self.config.hidden_size**0.5, x.dtype)

    def compute_logits(self, hidden: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        """(num_selected, hidden) -> (num_selected, vocab) float32 logits, soft-capped (in the model's
        dtype, as transformers caps them) where the config says."""
        cap = self.final_logit_softcap
        if cap is None:
            return super().compute_logits(hidden, decode_step)
        if isinstance(self.lm_head, QuantLinear):
            return soft_cap(self.lm_head(hidden, decode_step=decode_step), cap).float()
        return soft_cap(self.lm_head(hidden), cap).float()


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma2: soft-capped attention scores and final logits."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma3 text: per-head q/k norms, rope parameters per layer type, soft-capping as configured."""

    qk_norm = True
