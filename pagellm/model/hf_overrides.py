"""``--hf-overrides``: values set on a model's Hugging Face config after it is loaded, as in vLLM."""

from __future__ import annotations

import logging
from typing import Any

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def apply_hf_overrides(config: PretrainedConfig, overrides: dict[str, Any] | None,
                       prefix: str = "") -> PretrainedConfig:
    """Set each key of ``overrides`` on ``config`` and return it.

    A dict given for a nested config (``text_config``, say) updates that config key by key; any other
    value replaces the attribute (a dict such as ``rope_scaling`` included), as vLLM does. Each change
    is logged with the value it replaces.
    """
    if not overrides:
        return config
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"hf_overrides (--hf-overrides): {key!r} is not a config attribute name")
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value, prefix=f"{prefix}{key}.")
            continue
        setattr(config, key, value)
        if current is not None:
            logger.info("hf_overrides: %s%s = %r (the model's: %r)", prefix, key, value, current)
        else:
            logger.info("hf_overrides: %s%s = %r (not in the model's config)", prefix, key, value)
    return config
