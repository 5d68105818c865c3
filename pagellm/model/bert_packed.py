"""BERT's layers over packed tokens: the pooling runner's fast path for ``BertModel`` and ``XLMRobertaModel``.

A step's inputs differ in length. Padding them all to the longest wastes the linear layers' work on the
padding, and running each length group through the whole model (as sentence-transformers' batches do)
pays every layer's per-call costs once per group. Here the inputs are grouped by length
(``length_groups``: little padding in a group) and the groups laid out one after another as the rows of
one matrix: every token-wise operation (embeddings, projections, norms, MLP) runs once over all of them,
and attention runs per group on views of its rows, with no copy in or out (on a CPU whose memory is busy,
copies cost as much as the multiplies).

On CPU in float32 the linear weights are packed once for oneDNN (its blocked layout, instead of reordering
a plain weight on every call), query, key and value joined into one projection, and the activation and the
residual additions fused into the projections before them (oneDNN's post-ops): fewer, larger calls, each
one a parallel region less to synchronise on a busy machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# hidden_act -> oneDNN's fused (post-op, algorithm); others run unfused after the projection.
_FUSED_ACTS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
               "relu": ("relu", "")}


def length_groups(lengths: Sequence[int], slack: float = 1.25, min_pad: int = 8) -> list[list[int]]:
    """The inputs' indices grouped by length, shortest first: a group's longest input is at most ``slack``
    times its shortest plus ``min_pad`` tokens, so padding wastes little of its attention."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= lengths[groups[-1][0]] * slack + min_pad:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def onednn_usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class FusedLinear:
    """A projection's weight (packed for oneDNN where ``packed``) and bias, with its fused forms."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, act: str) -> None:
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if packed else weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def activated(self, x: torch.Tensor, fallback: object) -> torch.Tensor:
        """act(x W + b): fused where oneDNN has the activation, else ``fallback`` applied after."""
        if self.packed and self.act in _FUSED_ACTS:
            name, algorithm = _FUSED_ACTS[self.act]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, name, [], algorithm)
        return fallback(self(x))  # type: ignore[operator]

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x W + b + residual."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + residual


@dataclass
class PackedLayer:
    qkv: FusedLinear
    out: FusedLinear
    norm1: nn.LayerNorm
    up: FusedLinear
    act: object
    down: FusedLinear
    norm2: nn.LayerNorm
    num_heads: int
    head_dim: int


def pack_layers(layers: Iterable[Any], act: str, packed: bool) -> list[PackedLayer]:
    """Each ``BertLayer``'s weights for the packed forward (views of the loaded ones where not ``packed``)."""
    out = []
    for layer in layers:
        attn, dense = layer.attention.self, layer.attention.output.dense
        qkv_w = torch.cat([attn.query.weight, attn.key.weight, attn.value.weight])
        qkv_b = torch.cat([attn.query.bias, attn.key.bias, attn.value.bias])
        out.append(PackedLayer(
            FusedLinear(qkv_w, qkv_b, packed, ""), FusedLinear(dense.weight, dense.bias, packed, ""),
            layer.attention.output.LayerNorm,
            FusedLinear(layer.intermediate.dense.weight, layer.intermediate.dense.bias, packed, act),
            layer.intermediate.act,
            FusedLinear(layer.output.dense.weight, layer.output.dense.bias, packed, ""), layer.output.LayerNorm,
            int(attn.num_heads), int(attn.head_dim)))
    return out


@dataclass
class Group:
    """Inputs of like lengths (``members``, rows of the padded batch) padded to ``length``: rows ``offset`` to
    ``offset + count * length`` of the layout; ``mask`` hides the padding as keys (None: no padding)."""

    members: torch.Tensor
    count: int
    length: int
    offset: int
    mask: torch.Tensor | None


def layout(lengths: list[int], device: torch.device) -> list[Group]:
    """The groups of inputs of like lengths, one after another: the rows every token-wise layer runs over."""
    groups, offset = [], 0
    for members in length_groups(lengths):
        longest = max(lengths[i] for i in members)
        real = torch.tensor([[j < lengths[i] for j in range(longest)] for i in members])
        mask = None if bool(real.all()) else real[:, None, None, :].to(device)
        groups.append(Group(torch.tensor(members, device=device), len(members), longest, offset, mask))
        offset += len(members) * longest
    return groups


def to_layout(padded: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """``[batch, length, ...]`` -> the layout's rows ``[rows, ...]``."""
    return torch.cat([padded.index_select(0, g.members)[:, :g.length].reshape(g.count * g.length,
                                                                              *padded.shape[2:])
                      for g in groups])


def from_layout(rows: torch.Tensor, groups: list[Group], batch: int, length: int) -> torch.Tensor:
    """The layout's rows -> ``[batch, length, hidden]`` (zeros past each input's group length)."""
    out = rows.new_zeros((batch, length, rows.shape[-1]))
    for g in groups:
        block = rows[g.offset:g.offset + g.count * g.length].view(g.count, g.length, -1)
        out[g.members, :g.length] = block
    return out


def packed_layers_forward(layers: list[PackedLayer], x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """The encoder layers over the layout's rows ``x`` ``[rows, hidden]``: the token-wise layers once over
    every row, attention per group on views of its rows."""
    for layer in layers:
        qkv = layer.qkv(x)
        attn = x.new_empty(x.shape)
        for g in groups:
            rows = slice(g.offset, g.offset + g.count * g.length)
            q, k, v = qkv[rows].view(g.count, g.length, 3, layer.num_heads, layer.head_dim).unbind(2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=g.mask, scale=layer.head_dim ** -0.5)
            attn[rows].view(g.count, g.length, layer.num_heads, layer.head_dim).copy_(o.transpose(1, 2))
        h = layer.norm1(layer.out.plus(attn, x))
        x = layer.norm2(layer.down.plus(layer.up.activated(h, layer.act), h))
    return x
