"""Decode-only steps of a Llama-family model in one native call (``pagellm_decode_layers``).

A decode step runs the same nine kernels per layer; called one by one from Python they cost
interpreter time every step whatever the batch, most felt in the few-sequence steps that end a batch.
Where every kernel is the native one (bfloat16 weights, all
linears packed for the native kernel, a bfloat16 KV cache), the C side makes those calls itself, in
``DecoderLayer.forward``'s order, and the result is the same bits. Steps with prefills, other
dtypes and other devices take the layers' own ``forward``. The native attention backend builds it
(``step_driver``): the model asks its backend, whichever it is.
"""

from __future__ import annotations

import ctypes
from typing import Any, cast

import torch

from pagellm.kernels import native
from pagellm.model.attention.metadata import AttentionMetadata
from pagellm.model.attention.native_backend import DecodeBatch
from pagellm.model.packed_linear import PackedLinear
from pagellm.model.quant_linear import QuantLinear


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native_linear(layer: Any, gated: bool) -> bool:
    return isinstance(layer, PackedLinear) and layer.kernel == "native" and layer.gated == gated


class NativeDecoder:
    """The decoder layers of ``model`` over ``kv_caches``, for decode-only steps (the native attention
    backend's ``StepDriver``); build with ``create``."""

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pools = [(k, v) for k, v in kv_caches]
        # Every tensor the layer table points into, held so that its memory lives as long as the
        # table (the model drops its decoder when its tensors are moved or converted: ``_apply``).
        self.tensors: list[torch.Tensor] = []
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = model.config.hidden_size
        self.inter = model.layers[0].mlp.intermediate_size
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = float(attn.scale)
        self.rotary = attn.rotary
        self.block_size = kv_caches[0][0].shape[3]
        self.layers: ctypes.Array[Any] = (native.DecodeLayer * len(model.layers))()
        for slot, (layer, (k_cache, v_cache)) in zip(self.layers, zip(model.layers, kv_caches)):
            a, mlp = layer.self_attn, layer.mlp
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            slot.qkv, slot.o = a.qkv_proj.packed_weight.data_ptr(), a.o_proj.packed_weight.data_ptr()
            slot.gate_up, slot.down = mlp.gate_up_proj.packed_weight.data_ptr(), mlp.down_proj.packed_weight.data_ptr()
            slot.qkv_bias, slot.o_bias = _pointer(a.qkv_proj.bias), _pointer(a.o_proj.bias)
            slot.gate_up_bias, slot.down_bias = _pointer(mlp.gate_up_proj.bias), _pointer(mlp.down_proj.bias)
            slot.k_pool, slot.v_pool = k_cache.data_ptr(), v_cache.data_ptr()
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self.tensors += [t for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                         *(m.packed_weight for m in linears), *(m.bias for m in linears))
                             if t is not None]
        self.final_norm = model.norm.weight  # the model's last norm runs in the same call
        self.final_eps = float(model.norm.eps)
        self.tensors += [self.rotary.cos, self.rotary.sin, self.final_norm]

    def serves(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the layer table points into exactly these pools."""
        return len(kv_caches) == len(self.pools) and all(
            k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv_caches, self.pools))

    @classmethod
    def create(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> NativeDecoder | None:
        """The decoder where every kernel of a decode step is the native one and every shape is the one
        the C side assumes, else None."""
        if getattr(model, "native_step_driver", False) and all(
                isinstance(m, QuantLinear) for layer in model.layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj)):
            return QuantizedDecoder.create_quantized(model, kv_caches)
        bf16 = torch.bfloat16
        k0, v0 = kv_caches[0] if kv_caches else (None, None)
        # Device and dtype first: asking for the native kernels would compile them (not for a GPU).
        if (not getattr(model, "native_step_driver", False) or k0 is None or v0 is None
                or k0.device.type != "cpu" or k0.dtype != bf16 or len(kv_caches) != len(model.layers)
                or not native.linear_supported() or not native.supports(k0.device, k0.dtype)):
            return None
        first = model.layers[0]
        attn, hidden, inter = first.self_attn, model.config.hidden_size, first.mlp.intermediate_size
        rotary, eps = attn.rotary, first.input_layernorm.eps
        q_size, kv_size, head_dim = attn.q_size, attn.kv_size, attn.head_dim
        if not (rotary.cos.dtype == rotary.sin.dtype == torch.float32 and rotary.cos.is_contiguous()
                and rotary.sin.is_contiguous() and rotary.cos.shape == rotary.sin.shape
                and rotary.cos.shape[-1] == head_dim
                and tuple(k0.shape[1:]) == (attn.num_kv_heads, head_dim, k0.shape[3])
                and tuple(v0.shape[1:]) == (attn.num_kv_heads, k0.shape[3], head_dim)):
            return None
        # (in_features, out_features) of each linear, as the C side computes them.
        shapes = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * inter), (inter, hidden))
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_native_linear(m, m is mlp.gate_up_proj) and (m.in_features, m.out_features) == shape
                       for m, shape in zip(linears, shapes)):
                return None
            if (a.rotary is not rotary
                    or (a.num_heads, a.num_kv_heads, a.head_dim) != (attn.num_heads, attn.num_kv_heads, head_dim)):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != bf16 or not n.weight.is_contiguous() or n.weight.numel() != hidden or n.eps != eps
                   for n in norms):
                return None
            if any(c.dtype != bf16 or not c.is_contiguous() or c.shape != ref.shape
                   for c, ref in ((k_cache, k0), (v_cache, v0))):
                return None
        final = model.norm.weight
        if final.dtype != bf16 or not final.is_contiguous() or final.numel() != hidden:
            return None
        return cls(model, kv_caches)

    def accepts(self, meta: AttentionMetadata, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether this step is decodes only (on the native decode kernel, as the native backend lays
        them out), with the inputs ``pagellm_decode_layers`` takes (contiguous bfloat16 rows; int64
        positions, slots, tables)."""
        d = meta.decode
        return (isinstance(d, DecodeBatch) and not meta.prefills and d.num == x.shape[0]
                and x.dtype == torch.bfloat16 and x.is_contiguous()
                and all(t.dtype == torch.int64 and t.is_contiguous()
                        for t in (positions, meta.slot_mapping, d.tables, d.lens)))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states (after the model's last norm, as its ``forward`` returns them) for a
        decode-only step's embeddings ``x`` (rows in the order of ``meta.decode``); ``x`` is
        overwritten and returned. Check ``accepts`` first."""
        d = cast(DecodeBatch, meta.decode)
        rows = x.shape[0]
        scratch = native.scratch_enough(d.scratch, self.heads, self.head_dim, self.block_size, d.tables.shape[1])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        residual = torch.empty_like(x)
        normed = torch.empty_like(x)
        qkv = x.new_empty(rows, q_size + 2 * kv_size)
        attention = x.new_empty(rows, q_size)
        act = x.new_empty(rows, self.inter)
        step = native.DecodeStep(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.block_size,
            d.tables.shape[1], meta.sliding_window or 0, self.eps, self.scale,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), d.tables.data_ptr(), d.lens.data_ptr(),
            # (runs from attention.cascade_runs, which the kernel trusts; paged_decode_attention checks them)
            None if d.cascade is None else d.cascade.data_ptr(), 0 if d.cascade is None else d.cascade.shape[0],
            self.rotary.cos.data_ptr(), self.rotary.sin.data_ptr(), scratch.data_ptr(), normed.data_ptr(),
            qkv.data_ptr(), attention.data_ptr(), act.data_ptr(), self.final_norm.data_ptr(), self.final_eps)
        # Keep every buffer the step points into alive until the call returns.
        native.decode_layers(self.layers, step, x, residual)
        del normed, qkv, attention, act, scratch, residual
        return x



def _quant_matrix(layer: QuantLinear) -> native.QuantMatrix:
    matrix = native.QuantMatrix()
    matrix.count = len(layer.segments)
    for i, segment in enumerate(layer.segments):
        matrix.data[i], matrix.rows[i], matrix.type[i] = segment.data.data_ptr(), segment.shape[0], segment.ggml_type
    return matrix


class QuantizedDecoder(NativeDecoder):
    """The decode step in one native call for models whose linears keep quantized blocks
    (``QuantLinear``), in float32 or bfloat16: ``pagellm_decode_layers_quantized``, the layers'
    kernels in ``DecoderLayer.forward``'s order (the same bits as that forward)."""

    MAX_SEGMENTS = 3  # pagellm_quant_matrix's

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pools = [(k, v) for k, v in kv_caches]
        self.tensors = []
        attn = model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = model.config.hidden_size
        self.inter = model.layers[0].mlp.intermediate_size
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = float(attn.scale)
        self.rotary = attn.rotary
        self.block_size = kv_caches[0][0].shape[3]
        self.dtype = kv_caches[0][0].dtype
        self.layers = (native.DecodeQuantLayer * len(model.layers))()
        for slot, (layer, (k_cache, v_cache)) in zip(self.layers, zip(model.layers, kv_caches)):
            a, mlp = layer.self_attn, layer.mlp
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            slot.qkv, slot.o = _quant_matrix(a.qkv_proj), _quant_matrix(a.o_proj)
            slot.gate_up, slot.down = _quant_matrix(mlp.gate_up_proj), _quant_matrix(mlp.down_proj)
            slot.qkv_bias, slot.o_bias = _pointer(a.qkv_proj.bias), _pointer(a.o_proj.bias)
            slot.gate_up_bias, slot.down_bias = _pointer(mlp.gate_up_proj.bias), _pointer(mlp.down_proj.bias)
            slot.k_pool, slot.v_pool = k_cache.data_ptr(), v_cache.data_ptr()
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self.tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            self.tensors += [t for m in linears for t in (*(s.data for s in m.segments), m.bias) if t is not None]
        self.final_norm = model.norm.weight
        self.final_eps = float(model.norm.eps)
        self.tensors += [self.rotary.cos, self.rotary.sin, self.final_norm]

    @classmethod
    def create_quantized(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> QuantizedDecoder | None:
        """The decoder where every shape and dtype is what the C side assumes, else None."""
        k0, v0 = kv_caches[0] if kv_caches else (None, None)
        if (k0 is None or v0 is None or k0.device.type != "cpu" or k0.dtype not in native.DTYPE_CODES
                or len(kv_caches) != len(model.layers) or not native.supports(k0.device, k0.dtype)):
            return None
        first = model.layers[0]
        attn, hidden, inter = first.self_attn, model.config.hidden_size, first.mlp.intermediate_size
        rotary, eps = attn.rotary, first.input_layernorm.eps
        q_size, kv_size, head_dim = attn.q_size, attn.kv_size, attn.head_dim
        if not (rotary.cos.dtype == rotary.sin.dtype == torch.float32 and rotary.cos.is_contiguous()
                and rotary.sin.is_contiguous() and rotary.cos.shape == rotary.sin.shape
                and rotary.cos.shape[-1] == head_dim
                and tuple(k0.shape[1:]) == (attn.num_kv_heads, head_dim, k0.shape[3])
                and tuple(v0.shape[1:]) == (attn.num_kv_heads, k0.shape[3], head_dim)):
            return None
        shapes = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * inter), (inter, hidden))
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(len(m.segments) <= cls.MAX_SEGMENTS and (m.in_features, m.out_features) == shape
                       for m, shape in zip(linears, shapes)):
                return None
            if (a.rotary is not rotary
                    or (a.num_heads, a.num_kv_heads, a.head_dim) != (attn.num_heads, attn.num_kv_heads, head_dim)):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != k0.dtype or not n.weight.is_contiguous() or n.weight.numel() != hidden
                   or n.eps != eps for n in norms):
                return None
            if any(c.dtype != k0.dtype or not c.is_contiguous() or c.shape != ref.shape
                   for c, ref in ((k_cache, k0), (v_cache, v0))):
                return None
        final = model.norm.weight
        if final.dtype != k0.dtype or not final.is_contiguous() or final.numel() != hidden:
            return None
        return cls(model, kv_caches)

    def accepts(self, meta: AttentionMetadata, x: torch.Tensor, positions: torch.Tensor) -> bool:
        d = meta.decode
        return (isinstance(d, DecodeBatch) and not meta.prefills and d.num == x.shape[0]
                and x.dtype == self.dtype and x.is_contiguous()
                and all(t.dtype == torch.int64 and t.is_contiguous()
                        for t in (positions, meta.slot_mapping, d.tables, d.lens)))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d = cast(DecodeBatch, meta.decode)
        rows = x.shape[0]
        scratch = native.scratch_enough(d.scratch, self.heads, self.head_dim, self.block_size, d.tables.shape[1])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        residual = torch.empty_like(x)
        normed = torch.empty_like(x)
        qkv = x.new_empty(rows, q_size + 2 * kv_size)
        attention = x.new_empty(rows, q_size)
        act = x.new_empty(rows, self.inter)
        gate_up = x.new_empty(rows, 2 * self.inter)
        step = native.DecodeStep(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.block_size,
            d.tables.shape[1], meta.sliding_window or 0, self.eps, self.scale,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), d.tables.data_ptr(), d.lens.data_ptr(),
            None if d.cascade is None else d.cascade.data_ptr(), 0 if d.cascade is None else d.cascade.shape[0],
            self.rotary.cos.data_ptr(), self.rotary.sin.data_ptr(), scratch.data_ptr(), normed.data_ptr(),
            qkv.data_ptr(), attention.data_ptr(), act.data_ptr(), self.final_norm.data_ptr(), self.final_eps)
        native.decode_layers_quantized(self.layers, step, x, residual, gate_up)
        del normed, qkv, attention, act, gate_up, scratch, residual
        return x
