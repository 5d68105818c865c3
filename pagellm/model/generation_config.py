"""A checkpoint's ``generation_config.json`` as the default sampling settings of its requests.

As in vLLM (``--generation-config auto``), the sampling values a model's authors ship become the
defaults of requests that leave them unset, offline and in the server; ``vllm`` ignores the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagellm.sampling_params import SAMPLING_KEYS, SamplingParams

logger = logging.getLogger(__name__)


def default_sampling_fields(setting: str, model_folder: Path,
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams defaults that ``--generation-config setting`` gives for this model.

    ``auto``: the model folder's file; ``vllm``: none; any other value: a folder holding the file.
    ``overrides`` (``--override-generation-config``, generation_config.json's keys) are merged over
    the file's values, or stand alone with ``vllm``, as in vLLM.
    Raises ValueError when the file is not valid JSON or holds values SamplingParams refuses.
    """
    config, path = _read_generation_config(setting, model_folder)
    source = str(path) if path is not None else ""
    if overrides:
        config = {**config, **overrides}
        source = f"{source} and --override-generation-config" if source else "--override-generation-config"
    fields = {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
    if not fields:
        return fields
    try:
        SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        fix = "fix the file or start with --generation-config vllm to ignore it"
        if overrides:
            fix = "fix --override-generation-config" + (f" or {path}" if path is not None else "")
        raise ValueError(f"{source} has sampling values pagellm cannot use ({e}); {fix}") from e
    logger.info("default sampling parameters from %s: %s (requests that set them override them; "
                "--generation-config vllm ignores the file)", source,
                ", ".join(f"{k}={v}" for k, v in fields.items()))
    return fields


def _read_generation_config(setting: str, model_folder: Path) -> tuple[dict[str, Any], Path | None]:
    """The generation_config.json that ``setting`` names, and its path (``{}`` and None: no file)."""
    if setting == "vllm":
        return {}, None
    folder = model_folder if setting == "auto" else Path(setting).expanduser()
    if setting != "auto" and not folder.is_dir():
        raise ValueError(f"--generation-config {setting!r} is not 'auto', 'vllm' or a folder")
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting!r} holds no generation_config.json")
        return {}, None
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config, path
