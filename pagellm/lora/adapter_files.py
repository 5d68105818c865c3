"""An adapter's files, whichever format: a PEFT folder, or a llama.cpp LoRA GGUF file."""

from __future__ import annotations

from pathlib import Path

from pagellm.lora.gguf_adapter import read_gguf_adapter_config
from pagellm.lora.peft_config import AdapterConfig, read_adapter_config


def read_adapter(path: str | Path, max_rank: int, name: str = "") -> AdapterConfig:
    """The checked config of the adapter at ``path``: a ``.gguf`` file (or any file) is read as llama.cpp's
    LoRA GGUF, anything else as a PEFT folder; LoRAError for anything pagellm cannot serve."""
    local = Path(path).expanduser()
    if str(path).endswith(".gguf") or local.is_file():
        label = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"
        return read_gguf_adapter_config(local, max_rank, label)
    return read_adapter_config(path, max_rank, name)
