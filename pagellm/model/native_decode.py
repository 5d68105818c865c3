"""Decode-only steps of a Llama-family model in one native call (``pagellm_decode_layers``).

A decode step runs the same ten kernels per layer; called one by one from Python they cost ~1 ms of
interpreter time a step whatever the batch (4% of a 41-sequence step of the W1 model, 15-25% of the
few-sequence steps that end a batch). Where every kernel is the native one (bfloat16 weights, all
linears packed for the native kernel, a bfloat16 KV cache), the C side makes those calls itself, in
``DecoderLayer.forward``'s order, and the result is the same bits. Steps with prefills, other
dtypes and other devices take the layers' own ``forward``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagellm.kernels import native
from pagellm.model.attention import AttentionMetadata
from pagellm.model.packed_linear import PackedLinear


def _pointer(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _native_linear(layer: Any, gated: bool) -> bool:
    return isinstance(layer, PackedLinear) and layer.kernel == "native" and layer.gated == gated


class NativeDecoder:
    """The decoder layers of ``model`` over ``kv_caches``, for decode-only steps; build with ``create``."""

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pools = [(k, v) for k, v in kv_caches]  # held: the layer table points into them
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = model.config.hidden_size
        self.inter = model.layers[0].mlp.intermediate_size
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = float(attn.scale)
        self.rotary = attn.rotary
        self.block_size = kv_caches[0][0].shape[3]
        self.layers = (native.DecodeLayer * len(model.layers))()
        for slot, (layer, (k_cache, v_cache)) in zip(self.layers, zip(model.layers, kv_caches)):
            a, mlp = layer.self_attn, layer.mlp
            slot.input_norm, slot.post_norm = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
            slot.qkv, slot.o = a.qkv_proj.packed_weight.data_ptr(), a.o_proj.packed_weight.data_ptr()
            slot.gate_up, slot.down = mlp.gate_up_proj.packed_weight.data_ptr(), mlp.down_proj.packed_weight.data_ptr()
            slot.qkv_bias, slot.o_bias = _pointer(a.qkv_proj.bias), _pointer(a.o_proj.bias)
            slot.gate_up_bias, slot.down_bias = _pointer(mlp.gate_up_proj.bias), _pointer(mlp.down_proj.bias)
            slot.k_pool, slot.v_pool = k_cache.data_ptr(), v_cache.data_ptr()

    def serves(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the layer table points into exactly these pools."""
        return len(kv_caches) == len(self.pools) and all(
            k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv_caches, self.pools))

    @classmethod
    def create(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Optional["NativeDecoder"]:
        """The decoder where every kernel of a decode step is the native one, else None."""
        if not native.linear_supported() or not native.supports(kv_caches[0][0].device, kv_caches[0][0].dtype):
            return None
        bf16 = torch.bfloat16
        rotary = model.layers[0].self_attn.rotary
        if not (rotary.cos.dtype == rotary.sin.dtype == torch.float32 and rotary.cos.is_contiguous()
                and rotary.sin.is_contiguous()):
            return None
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            if not (_native_linear(a.qkv_proj, False) and _native_linear(a.o_proj, False)
                    and _native_linear(mlp.gate_up_proj, True) and _native_linear(mlp.down_proj, False)
                    and a.rotary is rotary and a.q_size == a.o_proj.in_features):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != bf16 or not n.weight.is_contiguous() or n.eps != norms[0].eps for n in norms):
                return None
            if any(c.dtype != bf16 or not c.is_contiguous() for c in (k_cache, v_cache)):
                return None
        return cls(model, kv_caches)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's MLP output, residual sum before it) for a decode-only step's embeddings ``x``
        (rows in the order of ``meta.native_decode``); ``x`` is overwritten."""
        d = meta.native_decode
        rows = x.shape[0]
        scratch = d.scratch
        needed = torch.get_num_threads() * native.load().pagellm_scratch_floats(
            self.heads, self.head_dim, self.block_size, d.tables.shape[1])
        if scratch.numel() < needed:  # threads were raised mid-step
            scratch = torch.empty(needed, dtype=torch.float32)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        residual = torch.empty_like(x)
        normed = torch.empty_like(x)
        qkv = x.new_empty(rows, q_size + 2 * kv_size)
        attention = x.new_empty(rows, q_size)
        act = x.new_empty(rows, self.inter)
        step = native.DecodeStep(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.block_size,
            d.tables.shape[1], window or 0, self.eps, self.scale,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), d.tables.data_ptr(), d.lens.data_ptr(),
            self.rotary.cos.data_ptr(), self.rotary.sin.data_ptr(), scratch.data_ptr(), normed.data_ptr(),
            qkv.data_ptr(), attention.data_ptr(), act.data_ptr())
        # Keep every buffer the step points into alive until the call returns.
        native.decode_layers(self.layers, step, x, residual)
        del normed, qkv, attention, act, scratch
        return x, residual


def decode_only(meta: AttentionMetadata, x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether this step is decodes only, all on the native decode kernel, with the inputs
    ``pagellm_decode_layers`` takes (contiguous bfloat16 rows; int64 positions, slots, tables)."""
    d = meta.native_decode
    return (d is not None and not meta.prefills and not meta.decode_groups and d.num == x.shape[0]
            and x.dtype == torch.bfloat16 and x.is_contiguous()
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in (positions, meta.slot_mapping, d.tables, d.lens)))
