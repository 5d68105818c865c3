"""Paged attention: write K/V into slots, attend over block tables, behind one backend interface.

Cache layout (per layer): values ``[num_blocks, num_kv_heads, block_size, head_dim]``; keys are stored
transposed, ``[num_blocks, num_kv_heads, head_dim, block_size]`` (as vLLM's paged-attention kernels
store them). One (block, KV head)'s values, like its keys, are one contiguous run that attention reads
from start to end (with token-major values, all heads of a token side by side, decode read a head's
rows 128 bytes at a time across the block: 11-15% slower on W1's shapes). In the key layout one
(block, head) is a ``head_dim x block_size`` matrix, so a query's scores for the block are a weighted
sum of its ``head_dim`` rows with the query as weights: an ``embedding_bag`` that reads the keys
straight from the pool (the PyTorch backend; the native kernel uses the same layout as 16-wide vector
rows). Values are likewise summed straight from the pool with the attention probabilities as
weights. Decode therefore never copies K or V.

A step's flat batch holds the decode tokens first (one per sequence), then each prefill (or prefill
chunk) as a run of tokens. The modules:

- ``metadata.py``: ``AttentionMetadata`` (slots, the decodes' backend-specific part, prefill spans;
  with KV cache groups, one per group, each layer reading its group's through ``for_group``), the
  last layer's ``OutputRows``, ``cascade_runs``.
- ``backend.py``: ``AttentionBackend`` (``prepare_decode``, ``write_kv``, ``decode``, ``prefill``,
  ``forward``, ``step_driver``) and ``AttentionConfig``, what a backend is chosen from. A layer may
  pass its own sliding window (``window``; by default the model-wide one in the metadata).
- ``native_backend.py``: the native CPU kernels (float32/bfloat16 pools on the CPU, no attention
  logit soft-capping).
- ``torch_backend.py``: PyTorch ops, everywhere else (soft-capped scores included).
- ``selector.py``: ``select_attention_backend``, called once by the model runner.
"""

from __future__ import annotations

import torch

from pagellm.model.attention.backend import (
    META_WINDOW,
    AttentionBackend,
    AttentionConfig,
    KVCache,
    StepDriver,
    Window,
    resolve_window,
)
from pagellm.model.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    DecodeMetadata,
    OutputRows,
    PrefillSpan,
    cascade_runs,
    choose_output_rows,
)
from pagellm.model.attention.native_backend import NativeAttentionBackend
from pagellm.model.attention.selector import BACKENDS, select_attention_backend
from pagellm.model.attention.torch_backend import (
    BAG_MIN_BLOCK_SIZE,
    DecodeGroup,
    DecodeGroups,
    TorchAttentionBackend,
    decode_group,
)

__all__ = [
    "AttentionBackend", "AttentionConfig", "AttentionMetadata", "BACKENDS", "BAG_MIN_BLOCK_SIZE", "DecodeBatch",
    "DecodeGroup", "DecodeGroups", "DecodeMetadata", "KVCache", "META_WINDOW", "NativeAttentionBackend",
    "OutputRows", "PrefillSpan", "StepDriver", "TorchAttentionBackend", "Window", "cascade_runs",
    "choose_output_rows", "decode_group", "resolve_window", "select_attention_backend", "write_kv",
]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store each token's K/V (``[num_tokens, num_kv_heads, head_dim]``) at its slot with the backend
    chosen for these pools: for tests and tools that fill pools; the model uses its runner's backend."""
    config = AttentionConfig.for_pools(k_cache, num_heads=k.shape[1])
    select_attention_backend(config).write_kv(k, v, k_cache, v_cache, meta)
