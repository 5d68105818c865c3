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
    gate/up, down where the MLP is the dense one."""
    hidden = model.config.hidden_size
    targets: dict[TargetKey, tuple[nn.Module, TargetLayout]] = {}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        targets[(i, "qkv_proj")] = (a.qkv_proj, TargetLayout(hidden, (("q_proj", a.q_size), ("k_proj", a.kv_size),
                                                                       ("v_proj", a.kv_size)),
                                                     head_dim=a.head_dim))
        targets[(i, "o_proj")] = (a.o_proj, TargetLayout(a.q_size, (("o_proj", hidden),)))
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            size = mlp.intermediate_size
            targets[(i, "gate_up_proj")] = (mlp.gate_up_proj, TargetLayout(hidden, (("gate_proj", size),
                                                                                     ("up_proj", size))))
            targets[(i, "down_proj")] = (mlp.down_proj, TargetLayout(size, (("down_proj", hidden),)))
    return targets


def make_lora_manager(model: Any, max_loras: int, max_cpu_loras: int, max_rank: int, dtype: torch.dtype,
                      device: torch.device) -> LoRAManager:
    """A LoRA manager whose hooks sit on ``model``'s projections."""
    if getattr(model, "_driver", None) is not None or any(
            getattr(getattr(layer.mlp, "gate_up_proj", None), "gated", False) for layer in model.layers):
        raise ValueError("LoRA needs the MLP's gate and up projections computed apart (load the model with "
                         "lora=True)")
    return LoRAManager(lora_targets(model), max_loras, max_cpu_loras, max_rank, dtype, device,
                       model_type=str(getattr(model.config, "model_type", "") or ""))
