"""llama.cpp's LoRA adapter files (``convert_lora_to_gguf.py``'s output), read with ``gguf``'s GGUFReader.

Such a file has ``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha`` and, per
adapted projection, ``blk.{i}.{attn_q,...}.weight.lora_a`` [r, in] and ``.lora_b`` [out, r] (PEFT's
orientation). llama.cpp's converter permutes the rows of Llama's q/k weights for its rotary layout, and an
adapter's lora_b with them (lora_a's rows are the rank, left alone); pagellm's GGUF model loader undoes it
for the base weights (transformers' Llama tensor processor), so it is undone here for lora_b alike. The
tensors come out under PEFT's names, and ``weights.py`` fuses and checks them as a PEFT adapter's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from pagellm.lora.peft_config import SUPPORTED_MODULES, AdapterConfig, LoRAError

# llama.cpp's tensor names -> PEFT's module names (and the block of the layer each sits in).
GGUF_MODULES = {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"),
                "attn_v": ("self_attn", "v_proj"), "attn_output": ("self_attn", "o_proj"),
                "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"), "ffn_down": ("mlp", "down_proj")}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# The GGUF architectures whose q/k rows llama.cpp permutes (those transformers' GGUF loader un-permutes).
ROPE_PERMUTED = ("llama",)
# A GGUF architecture -> the Hugging Face model types it stands for, where they differ (llama.cpp writes
# Mistral models as "llama").
_MODEL_TYPES = {"llama": ("llama", "mistral")}


def _field(reader: Any, key: str) -> Any:
    """A scalar or string field of the file's metadata (None where absent)."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _reader(path: Path, label: str) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise LoRAError(f"{label}: no such file; give a llama.cpp LoRA GGUF file (convert_lora_to_gguf.py's "
                        "output) or a PEFT adapter folder")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # (gguf raises ValueError, struct errors and the like for a damaged file)
        raise LoRAError(f"{label}: cannot read it as a GGUF file: {e}") from None


def read_gguf_adapter_config(path: Path, max_rank: int, label: str) -> AdapterConfig:
    """The checked config of the llama.cpp LoRA adapter at ``path``: rank from lora_a's shape, scaling
    alpha / r (llama.cpp's: 1 where alpha is 0), targets from the tensor names."""
    reader = _reader(path, label)
    kind, adapter = _field(reader, "general.type"), _field(reader, "adapter.type")
    if kind != "adapter" or adapter != "lora":
        what = f"general.type {kind!r}" + (f", adapter.type {adapter!r}" if adapter is not None else "")
        raise LoRAError(f"{label}: not a LoRA adapter GGUF file ({what}; a LoRA adapter has general.type "
                        "'adapter' and adapter.type 'lora'): give a model file as the model, and an adapter "
                        "written by llama.cpp's convert_lora_to_gguf.py here")
    if reader.get_field("adapter.alora.invocation_tokens") is not None:
        raise LoRAError(f"{label}: an activated LoRA (aLoRA, adapter.alora.invocation_tokens) is not supported")
    ranks: set[int] = set()
    modules: set[str] = set()
    for tensor in _lora_tensors(reader):
        layer_module = _module_of(tensor.name, label)
        modules.add(layer_module[1])
        if tensor.name.endswith("lora_a"):
            ranks.add(int(tensor.shape[1]))  # (ggml's order: [in, r])
    if not ranks:
        raise LoRAError(f"{label}: it holds no LoRA weights")
    if len(ranks) > 1:
        raise LoRAError(f"{label}: its projections have different ranks ({', '.join(map(str, sorted(ranks)))}); "
                        "pagellm serves adapters of one rank")
    rank = ranks.pop()
    if rank > max_rank:
        raise LoRAError(f"{label}: its rank r={rank} is more than --max-lora-rank {max_rank}: raise "
                        f"--max-lora-rank (max_lora_rank) to at least {rank}")
    alpha = float(_field(reader, "adapter.lora.alpha") or 0.0)
    scaling = alpha / rank if alpha else 1.0
    arch = str(_field(reader, "general.architecture") or "")
    return AdapterConfig(path, rank, scaling, tuple(m for m in SUPPORTED_MODULES if m in modules), gguf_arch=arch)


def _lora_tensors(reader: Any) -> list[Any]:
    """The file's LoRA tensors: norms (mergekit-extract-lora's) are left out, as llama.cpp leaves them."""
    return [t for t in reader.tensors if not t.name.endswith("_norm.weight")]


def _module_of(name: str, label: str) -> tuple[int, str, str]:
    """(layer, PEFT module name, "A" or "B") of a llama.cpp LoRA tensor's name; LoRAError for others."""
    m = _NAME.match(name)
    if m is None or m.group(2) not in GGUF_MODULES:
        raise LoRAError(f"{label}: tensor {name!r} is not a LoRA weight of a projection pagellm adapts "
                        f"({', '.join(GGUF_MODULES)}; e.g. blk.0.attn_q.weight.lora_a)")
    return int(m.group(1)), GGUF_MODULES[m.group(2)][1], m.group(3).upper()


def check_architecture(cfg: AdapterConfig, model_type: str, label: str) -> None:
    """LoRAError where the adapter's base architecture is not the model's (its q/k would be read wrong)."""
    arch = cfg.gguf_arch or ""
    if not arch or not model_type:
        return
    accepted = _MODEL_TYPES.get(arch, (arch,))
    norm = model_type.replace("_", "").replace("-", "").lower()
    if norm not in {a.replace("_", "").replace("-", "").lower() for a in accepted}:
        raise LoRAError(f"{label}: an adapter of a {arch!r} model, but the model is a {model_type!r}: give an "
                        "adapter converted against this base model")


def read_gguf_adapter_tensors(cfg: AdapterConfig, head_dim: int, label: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names (``layers.{i}.self_attn.q_proj.lora_A.weight``), float32,
    q/k lora_b un-permuted where llama.cpp permuted them (``head_dim``: the model's)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    reader = _reader(cfg.path, label)
    permuted = cfg.gguf_arch in ROPE_PERMUTED
    out: dict[str, torch.Tensor] = {}
    for tensor in _lora_tensors(reader):
        layer, module, which = _module_of(tensor.name, label)
        try:
            values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        except (NotImplementedError, ValueError) as e:
            raise LoRAError(f"{label}: tensor {tensor.name} has a type pagellm cannot read ({e})") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))  # (ggml lists the innermost dimension first)
        weights = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if permuted and which == "B" and module in ("q_proj", "k_proj"):
            weights = _unpermute_rows(weights, head_dim, label, tensor.name)
        part = GGUF_MODULES[tensor.name.split(".")[2]][0]
        out[f"layers.{layer}.{part}.{module}.lora_{which}.weight"] = weights
    return out


def _unpermute_rows(b: torch.Tensor, head_dim: int, label: str, name: str) -> torch.Tensor:
    """lora_b's rows back in Hugging Face's order: llama.cpp puts each head's rotary pairs (i, i + d/2)
    next to each other; this is transformers' ``_reverse_permute_weights`` for one head's width."""
    rows = b.shape[0]
    if head_dim <= 0 or head_dim % 2 or rows % head_dim:
        raise LoRAError(f"{label}: {name} has {rows} rows, not a whole number of this model's heads of {head_dim}: "
                        "an adapter of another base model?")
    return b.reshape(rows // head_dim, head_dim // 2, 2, -1).transpose(1, 2).reshape(b.shape).contiguous()
