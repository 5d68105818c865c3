"""Choosing the attention backend, once per engine (vLLM's ``get_attn_backend``)."""

from __future__ import annotations

from pagellm.model.attention.backend import AttentionBackend, AttentionConfig
from pagellm.model.attention.native_backend import NativeAttentionBackend
from pagellm.model.attention.torch_backend import TorchAttentionBackend

# In order of preference; the last one runs every configuration.
BACKENDS: tuple[type[AttentionBackend], ...] = (NativeAttentionBackend, TorchAttentionBackend)


def select_attention_backend(config: AttentionConfig) -> AttentionBackend:
    """The first backend of ``BACKENDS`` that supports ``config``."""
    reasons = []
    for backend in BACKENDS:
        reason = backend.unsupported(config)
        if reason is None:
            return backend(config)
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(f"no attention backend runs {config}: " + "; ".join(reasons))
