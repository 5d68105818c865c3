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
from collections.abc import Callable
from typing import Any, cast

import torch

from pagellm.kernels import native, quant
from pagellm.model.attention.metadata import AttentionMetadata, DecodeBatch
from pagellm.model.packed_linear import PackedLinear
from pagellm.model.quant_linear import QuantLinear


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native_linear(layer: Any, gated: bool) -> bool:
    return isinstance(layer, PackedLinear) and layer.kernel == "native" and layer.gated == gated


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    a, mlp = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def _fill_shared(slot: Any, layer: Any, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The fields both layer tables hold alike: norms, biases, pools."""
    qkv, o, gate_up, down = _linears(layer)
    slot.input_norm = layer.input_layernorm.weight.data_ptr()
    slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
    slot.qkv_bias, slot.o_bias = _pointer(qkv.bias), _pointer(o.bias)
    slot.gate_up_bias, slot.down_bias = _pointer(gate_up.bias), _pointer(down.bias)
    slot.k_pool, slot.v_pool = k_cache.data_ptr(), v_cache.data_ptr()


def _quant_matrix(layer: QuantLinear) -> quant.QuantMatrix:
    matrix = quant.QuantMatrix()
    matrix.count = len(layer.segments)
    for i, segment in enumerate(layer.segments):
        matrix.data[i], matrix.rows[i], matrix.type[i] = segment.data.data_ptr(), segment.shape[0], segment.ggml_type
    return matrix


class NativeDecoder:
    """The decoder layers of ``model`` over ``kv_caches``, for decode-only steps (the native attention
    backend's ``StepDriver``); build with ``create``. This class drives bfloat16 models whose linears
    are packed for the native kernel (``pagellm_decode_layers``); ``QuantizedDecoder`` those whose
    linears keep quantized blocks."""

    # How the quantized layers take their inputs (quant_linear.py's modes; "float" for 16-bit layers).
    inputs = "float"

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
        self.dtype = kv_caches[0][0].dtype
        self.layers = self._layer_table(model, kv_caches)
        for layer in model.layers:
            self.tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            self.tensors += [m.bias for m in _linears(layer) if m.bias is not None]
        self.final_norm = model.norm.weight  # the model's last norm runs in the same call
        self.final_eps = float(model.norm.eps)
        self.tensors += [self.rotary.cos, self.rotary.sin, self.final_norm]

    def _layer_table(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array[Any]:
        layers = (native.DecodeLayer * len(model.layers))()
        for slot, layer, (k_cache, v_cache) in zip(layers, model.layers, kv_caches):
            qkv, o, gate_up, down = _linears(layer)
            _fill_shared(slot, layer, k_cache, v_cache)
            slot.qkv, slot.o = qkv.packed_weight.data_ptr(), o.packed_weight.data_ptr()
            slot.gate_up, slot.down = gate_up.packed_weight.data_ptr(), down.packed_weight.data_ptr()
            self.tensors += [m.packed_weight for m in (qkv, o, gate_up, down)]
        return layers

    def serves(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the layer table points into exactly these pools."""
        return len(kv_caches) == len(self.pools) and all(
            k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv_caches, self.pools))

    @classmethod
    def create(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> NativeDecoder | None:
        """The decoder where every kernel of a decode step is the native one and every shape is the one
        the C side assumes, else None."""
        if not getattr(model, "native_step_driver", False):
            return None
        if all(isinstance(m, QuantLinear) for layer in model.layers for m in _linears(layer)):
            return QuantizedDecoder.create_quantized(model, kv_caches)
        k0 = kv_caches[0][0] if kv_caches else None
        # Device and dtype first: asking for the native kernels would compile them (not for a GPU).
        if (k0 is None or k0.device.type != "cpu" or k0.dtype != torch.bfloat16 or not native.linear_supported()
                or not cls._fits(model, kv_caches, lambda m, gated: _native_linear(m, gated))):
            return None
        return cls(model, kv_caches)

    @staticmethod
    def _fits(model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              linear_ok: Callable[[Any, bool], bool]) -> bool:
        """Whether every shape and dtype is what the C side assumes: the pools' dtype throughout (norms,
        pools), one rotary table, the same heads in every layer, linears of the C side's shapes that
        ``linear_ok(linear, is_gate_up)`` accepts."""
        k0, v0 = kv_caches[0] if kv_caches else (None, None)
        if (k0 is None or v0 is None or len(kv_caches) != len(model.layers)
                or not native.supports(k0.device, k0.dtype)):
            return False
        dtype = k0.dtype
        first = model.layers[0]
        attn, hidden, inter = first.self_attn, model.config.hidden_size, first.mlp.intermediate_size
        rotary, eps = attn.rotary, first.input_layernorm.eps
        q_size, kv_size, head_dim = attn.q_size, attn.kv_size, attn.head_dim
        if not (rotary.cos.dtype == rotary.sin.dtype == torch.float32 and rotary.cos.is_contiguous()
                and rotary.sin.is_contiguous() and rotary.cos.shape == rotary.sin.shape
                and rotary.cos.shape[-1] == head_dim
                and tuple(k0.shape[1:]) == (attn.num_kv_heads, head_dim, k0.shape[3])
                and tuple(v0.shape[1:]) == (attn.num_kv_heads, k0.shape[3], head_dim)):
            return False
        # (in_features, out_features) of each linear, as the C side computes them.
        shapes = ((hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * inter), (inter, hidden))
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, linears = layer.self_attn, _linears(layer)
            if not all(linear_ok(m, m is layer.mlp.gate_up_proj) and (m.in_features, m.out_features) == shape
                       for m, shape in zip(linears, shapes)):
                return False
            if (a.rotary is not rotary
                    or (a.num_heads, a.num_kv_heads, a.head_dim) != (attn.num_heads, attn.num_kv_heads, head_dim)):
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != dtype or not n.weight.is_contiguous() or n.weight.numel() != hidden
                   or n.eps != eps for n in norms):
                return False
            if any(c.dtype != dtype or not c.is_contiguous() or c.shape != ref.shape
                   for c, ref in ((k_cache, k0), (v_cache, v0))):
                return False
        final = model.norm.weight
        return final.dtype == dtype and final.is_contiguous() and final.numel() == hidden

    def accepts(self, meta: AttentionMetadata, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether this step is decodes only (on the native decode kernel, as the native backend lays
        them out), with the inputs the C side takes (contiguous rows of the pools' dtype; int64
        positions, slots, tables)."""
        d = meta.decode
        return (isinstance(d, DecodeBatch) and not meta.prefills and d.num == x.shape[0]
                and (meta.prompt_rows is None or self.inputs != "decode")  # (a prompt's last token: float)
                and x.dtype == self.dtype and x.is_contiguous()
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
        self._run(step, x, residual)
        del normed, qkv, attention, act, scratch, residual
        return x

    def _run(self, step: native.DecodeStep, x: torch.Tensor, residual: torch.Tensor) -> None:
        native.decode_layers(self.layers, step, x, residual)


class QuantizedDecoder(NativeDecoder):
    """The decode step in one native call for models whose linears keep quantized blocks
    (``QuantLinear``), in float32 or bfloat16: ``pagellm_decode_layers_quantized``, the layers'
    kernels in ``DecoderLayer.forward``'s order (the same bits as that forward)."""

    MAX_SEGMENTS = 3  # pagellm_quant_matrix's

    def _layer_table(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array[Any]:
        # One mode for the whole step, the one every decoder layer's QuantLinear took at load.
        self.inputs = _linears(model.layers[0])[0].inputs
        self.int8_activations = self.inputs != "float"
        layers = (quant.DecodeQuantLayer * len(model.layers))()
        for slot, layer, (k_cache, v_cache) in zip(layers, model.layers, kv_caches):
            qkv, o, gate_up, down = _linears(layer)
            _fill_shared(slot, layer, k_cache, v_cache)
            slot.qkv, slot.o, slot.gate_up, slot.down = (_quant_matrix(m) for m in (qkv, o, gate_up, down))
            self.tensors += [s.data for m in (qkv, o, gate_up, down) for s in m.segments]
        return layers

    @classmethod
    def create_quantized(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> QuantizedDecoder | None:
        """The decoder where every shape and dtype is what the C side assumes, else None."""
        k0 = kv_caches[0][0] if kv_caches else None
        if k0 is None or k0.device.type != "cpu" or k0.dtype not in native.DTYPE_CODES or not cls._fits(
                model, kv_caches, lambda m, gated: len(m.segments) <= cls.MAX_SEGMENTS):
            return None
        return cls(model, kv_caches)

    def _run(self, step: native.DecodeStep, x: torch.Tensor, residual: torch.Tensor) -> None:
        gate_up = x.new_empty(x.shape[0], 2 * self.inter)
        quant.decode_layers_quantized(self.layers, step, x, residual, gate_up, self.int8_activations)
