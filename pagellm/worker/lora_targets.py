"""The projections of a loaded model that LoRA adapters may target, with their shapes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.lora.manager import LoRAManager
from pagellm.lora.weights import TargetKey, TargetLayout
from pagellm.model.layers import GatedMLP


def lora_targets(model: Any) -> dict[TargetKey, tuple[nn.Module, TargetLayout]]:
    """(layer, fused projection) -> (its module, its layout), for every Llama-family layer: q/k/v, o, and
    gate/up, down where the MLP is the dense one. Under tensor parallelism the layouts are the rank's share
    (the ``tp_spans`` distributed/sharding.py left), and o/down's hooks sit inside their all-reduce: a
    rank adds its adapter partial to its base partial, and the one all-reduce sums both."""
    hidden = model.config.hidden_size
    targets: dict[TargetKey, tuple[nn.Module, TargetLayout]] = {}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        spans = a.tp_spans
        qkv = ("q_proj", "k_proj", "v_proj")
        targets[(i, "qkv_proj")] = (a.qkv_proj, TargetLayout(
            hidden, (("q_proj", a.q_size), ("k_proj", a.kv_size), ("v_proj", a.kv_size)), head_dim=a.head_dim,
            row_spans=tuple(spans[p] for p in qkv) if spans else None))
        targets[(i, "o_proj")] = (_inner(a.o_proj), TargetLayout(a.q_size, (("o_proj", hidden),),
                                                                 in_span=spans["o_proj"] if spans else None))
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            size = mlp.intermediate_size
            spans = mlp.tp_spans
            targets[(i, "gate_up_proj")] = (mlp.gate_up_proj, TargetLayout(
                hidden, (("gate_proj", size), ("up_proj", size)),
                row_spans=(spans["gate_proj"], spans["up_proj"]) if spans else None))
            targets[(i, "down_proj")] = (_inner(mlp.down_proj), TargetLayout(
                size, (("down_proj", hidden),), in_span=spans["down_proj"] if spans else None))
    return targets


def _inner(module: nn.Module) -> nn.Module:
    """The projection itself, inside a tensor-parallel rank's all-reduce (distributed/sharding.py's
    ``AllReduced``, whose ``inner`` it is): the hook adds the partial before the sum."""
    inner = getattr(module, "inner", None)
    return inner if isinstance(inner, nn.Module) else module


def make_lora_manager(model: Any, max_loras: int, max_cpu_loras: int, max_rank: int, dtype: torch.dtype,
                      device: torch.device) -> LoRAManager:
    """A LoRA manager whose hooks sit on ``model``'s projections."""
    if getattr(model, "_driver", None) is not None or any(
            getattr(getattr(layer.mlp, "gate_up_proj", None), "gated", False) for layer in model.layers):
        raise ValueError("LoRA needs the MLP's gate and up projections computed apart (load the model with "
                         "lora=True)")
    return LoRAManager(lora_targets(model), max_loras, max_cpu_loras, max_rank, dtype, device,
                       model_type=str(getattr(model.config, "model_type", "") or ""))
