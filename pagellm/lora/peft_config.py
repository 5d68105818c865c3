"""A PEFT adapter's folder: ``adapter_config.json`` read and checked against what pagellm computes.

Light (json only): the engine checks an adapter when a request names it, before anything is queued.
Every refusal is a ``LoRAError`` (a ValueError: a 400 from the server) saying what was wrong and what to do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of a Llama-family layer an adapter may target (PEFT's names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES


class LoRAError(ValueError):
    """An adapter pagellm cannot serve, and why."""


@dataclass(frozen=True)
class AdapterConfig:
    """What pagellm reads of an adapter's config: its rank, the scaling of B @ A, its target modules."""

    path: Path  # the adapter's folder
    rank: int
    scaling: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    target_modules: tuple[str, ...]  # a subset of SUPPORTED_MODULES (those the config names)
    gguf_arch: str | None = None  # a llama.cpp GGUF adapter (path: the file): its base architecture

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter_config(folder: str | Path, max_rank: int, name: str = "") -> AdapterConfig:
    """The checked config of the PEFT adapter in ``folder``; LoRAError for anything pagellm cannot serve
    (``adapter_files.read_adapter`` takes llama.cpp's GGUF files too)."""
    label = f"LoRA adapter {name!r} ({folder})" if name else f"LoRA adapter {folder}"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise LoRAError(f"{label}: no such folder; give a folder holding {CONFIG_FILE} and {WEIGHTS_FILE} (or a "
                        "llama.cpp LoRA .gguf file)")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / needed).is_file():
            hint = " (a .bin adapter: save it again with safe_serialization=True)" if (
                needed == WEIGHTS_FILE and (path / "adapter_model.bin").is_file()) else ""
            raise LoRAError(f"{label}: {needed} is missing{hint}")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{label}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{label}: {CONFIG_FILE} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{label}: peft_type {peft_type} is not supported (only LORA)")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{label}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{label}: its rank r={rank} is more than --max-lora-rank {max_rank}: raise "
                        f"--max-lora-rank (max_lora_rank) to at least {rank}")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("modules_to_save", "modules_to_save"), ("layer_replication", "layer_replication")):
        if cfg.get(key):
            raise LoRAError(f"{label}: {what} adapters are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{label}: bias {cfg['bias']!r} is not supported (only 'none')")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{label}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return AdapterConfig(path, rank, float(scaling), target_modules(cfg.get("target_modules"), label))


def target_modules(targets: object, label: str) -> tuple[str, ...]:
    """PEFT's ``target_modules`` (a list of names, one name, a regex, or "all-linear") as supported names."""
    if targets == "all-linear":
        return SUPPORTED_MODULES
    if isinstance(targets, str):
        if targets in SUPPORTED_MODULES:
            return (targets,)
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise LoRAError(f"{label}: target_modules {targets!r} is not a valid regex ({e})") from None
        names = tuple(m for m in SUPPORTED_MODULES
                      if any(pattern.fullmatch(f"model.layers.0.{part}.{m}") for part in ("self_attn", "mlp")))
        if not names:
            raise LoRAError(f"{label}: target_modules {targets!r} matches none of {', '.join(SUPPORTED_MODULES)}")
        return names
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{label}: target_modules must be a list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
    if unknown:
        raise LoRAError(f"{label}: target module(s) {', '.join(unknown)} are not supported; an adapter may target "
                        f"{', '.join(SUPPORTED_MODULES)}")
    return tuple(m for m in SUPPORTED_MODULES if m in targets)
