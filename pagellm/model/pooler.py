"""Pooling as sentence-transformers configures it: ``modules.json`` names the modules after the encoder,
``1_Pooling/config.json`` the pooling mode (CLS, mean, max, mean over sqrt(length), last token) and a
``Normalize`` module L2-normalises, as vLLM reads them. A folder without ``modules.json`` pools by
``default_mode`` (vLLM's default for BERT-like encoders is CLS) and normalises."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
# sentence-transformers' keys in 1_Pooling/config.json -> the mode.
_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_TYPES = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json's limit, if any
    from_sentence_transformers: bool = False


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data


def read_pooling_config(folder: Path, default_mode: str = "cls") -> PoolingConfig:
    """The folder's pooling; ValueError naming a module or mode that pagellm does not run."""
    max_len = None
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = _read_json(st_config).get("max_seq_length")
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(default_mode, True, max_len)
    modules = _read_json(modules_file)
    mode, normalize = default_mode, False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_TYPES)
        if kind in ("Transformer", "models.Transformer"):
            continue
        if kind == "Pooling":
            mode = _pooling_mode(folder / module.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_file}: the sentence-transformers module {module.get('type')!r} is not "
                             "supported (pagellm runs Transformer, Pooling and Normalize)")
    return PoolingConfig(mode, normalize, max_len, True)


def _pooling_mode(folder: Path) -> str:
    config = _read_json(folder / "config.json")
    if "pooling_mode" in config:  # newer sentence-transformers write the mode by name
        name = str(config["pooling_mode"]).replace("mean_tokens", "mean").replace("cls_token", "cls")
        name = {"max_tokens": "max", "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(name, name)
        modes = [name]
    else:
        modes = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{folder / 'config.json'}: pagellm pools by exactly one of {', '.join(POOLING_MODES)}; "
                         f"this configuration asks for {modes or 'none'}")
    if config.get("include_prompt") is False:
        raise ValueError(f"{folder / 'config.json'}: include_prompt=false is not supported")
    return modes[0]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``[batch, length, hidden]`` over the real tokens of each row (``attention_mask``) -> ``[batch, hidden]``,
    computed in float32."""
    h = hidden.float()
    m = attention_mask.to(h.dtype).unsqueeze(-1)
    if mode == "cls":
        return h[:, 0]
    if mode in ("mean", "mean_sqrt_len"):
        total = (h * m).sum(dim=1)
        count = m.sum(dim=1).clamp(min=1e-9)
        return total / (count if mode == "mean" else count.sqrt())
    if mode == "max":
        return h.masked_fill(m == 0, -1e9).max(dim=1).values
    if mode == "lasttoken":
        last = attention_mask.long().sum(dim=1) - 1
        return h[torch.arange(h.shape[0], device=h.device), last.clamp(min=0)]
    raise ValueError(f"unknown pooling mode {mode!r}; known: {', '.join(POOLING_MODES)}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)
