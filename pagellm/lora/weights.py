"""A PEFT adapter's tensors as pagellm computes them: per fused projection of each layer, ``A^T`` (the
targeted parts' A side by side) and each part's ``B^T`` (scaled; None for a part it leaves alone)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from pagellm.lora.peft_config import SUPPORTED_MODULES, AdapterConfig, LoRAError

# (layer index, fused projection's name): e.g. (3, "qkv_proj").
TargetKey = tuple[int, str]
# (start, end, whole width): a tensor-parallel rank's share of a dimension.
Span = tuple[int, int, int]
# PEFT's names in a saved adapter: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class TargetLayout:
    """One fused projection of the model: its input width and its output's parts (PEFT name, width).

    Under tensor parallelism the widths are the rank's; ``row_spans`` (column-parallel: per part, the
    rank's output rows of the whole part) or ``in_span`` (row-parallel: its input columns) say which,
    as (start, end, whole width): an adapter's B rows or A columns are cut alike."""

    in_features: int
    parts: tuple[tuple[str, int], ...]
    head_dim: int = 0  # attention's q/k/v: one head's width (to undo llama.cpp's q/k row order)
    row_spans: tuple[Span, ...] | None = None
    in_span: Span | None = None

    @property
    def out_features(self) -> int:
        return sum(width for _, width in self.parts)


# The PEFT projections that make up each of pagellm's fused ones, in output order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


# A^T [in, k*r] (the k parts it adapts, in output order), and per such part (its first column of the
# projection's output, its B^T [r, width]).
FusedLoRA = tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]


@dataclass
class LoRAWeights:
    """One adapter's tensors, per targeted fused projection."""

    name: str
    rank: int
    tensors: dict[TargetKey, FusedLoRA]
    # Per projection, the parts' B^T block-diagonal over its whole output [k*r, out] (zero elsewhere): one
    # matmul for a few rows, where the calls cost more than the zeros read.
    full_b: dict[TargetKey, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> LoRAWeights:
        moved = {k: (a.to(device), [(off, b.to(device)) for off, b in bs]) for k, (a, bs) in self.tensors.items()}
        return LoRAWeights(self.name, self.rank, moved, {k: b.to(device) for k, b in self.full_b.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for a, bs in self.tensors.values() for t in (a, *(b for _, b in bs)))


def load_lora_weights(cfg: AdapterConfig, layout: dict[TargetKey, TargetLayout], dtype: torch.dtype,
                      name: str = "", model_type: str = "") -> LoRAWeights:
    """The adapter's tensors for a model of ``layout`` (and of ``model_type``, checked against a GGUF
    adapter's base architecture); LoRAError where they do not fit it."""
    label = f"LoRA adapter {name!r} ({cfg.path})"
    raw = _read_tensors(cfg, layout, model_type, label)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"{label}: tensor {key!r} is not a LoRA A/B weight of a projection pagellm adapts "
                            f"({', '.join(SUPPORTED_MODULES)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise LoRAError(f"{label}: target module {module} is not supported; an adapter may target "
                            f"{', '.join(SUPPORTED_MODULES)}")
        found.setdefault((layer, module), {})[which] = tensor
    if not found:
        raise LoRAError(f"{label}: {cfg.path.name if cfg.gguf_arch is not None else cfg.weights_path.name} holds "
                        "no LoRA weights")
    num_layers = 1 + max(layer for layer, _ in layout)
    tensors: dict[TargetKey, FusedLoRA] = {}
    full_b: dict[TargetKey, torch.Tensor] = {}
    for fused, parts in FUSED_PARTS.items():
        for layer in range(num_layers):
            present = [p for p in parts if (layer, p) in found]
            if present and layer < num_layers:
                target = layout.get((layer, fused))
                if target is None:
                    raise LoRAError(f"{label}: it adapts {', '.join(present)} of layer {layer}, which this model "
                                    "computes in a way pagellm does not adapt (e.g. a mixture of experts)")
                tensors[(layer, fused)] = _fuse(found, layer, present, target, cfg, dtype, label)
                full_b[(layer, fused)] = _block_diagonal(tensors[(layer, fused)], target.out_features)
    extra = sorted({layer for layer, _ in found if layer >= num_layers})
    if extra:
        raise LoRAError(f"{label}: it adapts layer {extra[0]} but the model has {num_layers} layers: an adapter of "
                        "another base model?")
    return LoRAWeights(name, cfg.rank, tensors, full_b)


def _read_tensors(cfg: AdapterConfig, layout: dict[TargetKey, TargetLayout], model_type: str, label: str
                  ) -> dict[str, torch.Tensor]:
    """The adapter's tensors by PEFT's names: its safetensors file, or its llama.cpp GGUF file's."""
    if cfg.gguf_arch is not None:
        from pagellm.lora.gguf_adapter import check_architecture, read_gguf_adapter_tensors

        check_architecture(cfg, model_type, label)
        head_dim = next((t.head_dim for (_, fused), t in layout.items() if fused == "qkv_proj"), 0)
        return read_gguf_adapter_tensors(cfg, head_dim, label)
    from safetensors.torch import load_file

    try:
        return load_file(str(cfg.weights_path))
    except Exception as e:  # (safetensors raises its own error types for a damaged file)
        raise LoRAError(f"{label}: cannot read {cfg.weights_path.name}: {e}") from None


def _block_diagonal(fused: FusedLoRA, out_features: int) -> torch.Tensor:
    a_t, parts = fused
    r = a_t.shape[1] // len(parts)
    full = a_t.new_zeros(a_t.shape[1], out_features)
    for k, (offset, b) in enumerate(parts):
        full[k * r : (k + 1) * r, offset : offset + b.shape[1]] = b
    return full


def _fuse(found: dict[tuple[int, str], dict[str, torch.Tensor]], layer: int, present: list[str],
          target: TargetLayout, cfg: AdapterConfig, dtype: torch.dtype, label: str
          ) -> FusedLoRA:
    """A^T and the parts' B^T (scaled) of one fused projection from its present parts."""
    r = cfg.rank
    a_t = torch.zeros(target.in_features, r * len(present), dtype=torch.float32)
    b_parts: list[tuple[int, torch.Tensor]] = []
    col = offset = 0
    for j, (part, width) in enumerate(target.parts):
        if part in present:
            ab = found[(layer, part)]
            if "A" not in ab or "B" not in ab:
                raise LoRAError(f"{label}: layer {layer} {part} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
            a, b = ab["A"].float(), ab["B"].float()
            rows = target.row_spans[j] if target.row_spans is not None else (0, width, width)
            cols = target.in_span or (0, target.in_features, target.in_features)
            if tuple(a.shape) != (r, cols[2]) or tuple(b.shape) != (rows[2], r):
                raise LoRAError(f"{label}: layer {layer} {part} has A {tuple(a.shape)} and B {tuple(b.shape)}, but "
                                f"rank {r} on this model needs A {(r, cols[2])} and B {(rows[2], r)}: an "
                                "adapter of another base model?")
            a, b = a[:, cols[0] : cols[1]], b[rows[0] : rows[1]]  # (this rank's share, as the base weight's)
            a_t[:, col : col + r] = a.T
            b_parts.append((offset, (b.T * cfg.scaling).to(dtype).contiguous()))
            col += r
        offset += width
    return a_t.to(dtype).contiguous(), b_parts
