"""The one interface every attention implementation offers the model runner and the model.

As in vLLM, a backend is chosen once, when the model runner is built (``selector.py``), from what
does not change while the engine runs: device, dtype, head shapes, block size, sliding window,
attention logit soft-capping and what the CPU and the native kernels can do. The one error
convention: a backend says at selection (``unsupported``) whether it runs a configuration; once
chosen, each call either does its work or raises, never reports "not done" for a caller to fall back.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch

from pagellm.model.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillSpan

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer: layouts in __init__.py


class _MetaWindow(enum.Enum):
    MODEL_WIDE = "the metadata's sliding window"


# A layer's attention window for ``decode``/``forward``: its tokens, None for full attention, or
# META_WINDOW for the model-wide one in ``AttentionMetadata.sliding_window`` (families whose layers
# all share one window, as Mistral; Gemma's layers alternate sliding and full attention).
META_WINDOW = _MetaWindow.MODEL_WIDE
Window = int | None | Literal[_MetaWindow.MODEL_WIDE]


def resolve_window(window: Window, meta: AttentionMetadata) -> int | None:
    """The window in tokens (None: full attention) that ``window`` stands for in this step."""
    return meta.sliding_window if window is META_WINDOW else window


@dataclass(frozen=True)
class AttentionConfig:
    """What a backend is chosen from (fixed for the engine's life)."""

    device: torch.device
    dtype: torch.dtype  # of the K/V pools (the model's)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: int | None = None  # the model-wide window (a layer may pass its own)
    # Attention logit soft-capping (Gemma2): scores become tanh(scores / cap) * cap before the softmax.
    logit_softcap: float | None = None

    @classmethod
    def for_pools(cls, k_cache: torch.Tensor, num_heads: int,
                  sliding_window: int | None = None) -> AttentionConfig:
        """The configuration of a key pool ``[num_blocks, num_kv_heads, head_dim, block_size]``."""
        _, num_kv_heads, head_dim, block_size = k_cache.shape
        return cls(k_cache.device, k_cache.dtype, num_heads, num_kv_heads, head_dim, block_size, sliding_window)


class StepDriver(Protocol):
    """Runs every layer of a decode-only step in one call (a backend's ``step_driver``), the same bits as
    the layers' own ``forward``."""

    def serves(self, kv_caches: list[KVCache]) -> bool:
        """Whether it points into exactly these pools."""
        ...

    def accepts(self, meta: AttentionMetadata, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether this step is one it runs (decodes only, inputs of the layout it reads)."""
        ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final (normed) hidden states for the step's embeddings ``x``."""
        ...


class AttentionBackend(ABC):
    """Paged attention over the K/V pools: write new tokens' K/V into their slots, attend the decodes
    (one query each) and the prefills (a causal run of queries after the cached context)."""

    name: ClassVar[str]
    # Whether ``decode`` reads the blocks that adjacent decodes share once for them all (cascade): the
    # model runner then puts decodes with the same first block side by side and hands the runs
    # (``cascade_runs``) to ``prepare_decode``.
    cascade: bool = False

    def __init__(self, config: AttentionConfig) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def unsupported(cls, config: AttentionConfig) -> str | None:
        """Why this backend cannot run ``config``; None where it can. Asked once, at selection."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name

    @abstractmethod
    def prepare_decode(self, tables: list[list[int]], context_lens: list[int],
                       cascade: list[tuple[int, int, int]]) -> DecodeMetadata:
        """The step's decodes (rows ``[0, len(tables))`` of the flat batch): each one's block table and
        context length (its new token included), in batch order; ``cascade``: runs of them sharing their
        first blocks (empty unless ``self.cascade``)."""

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Store each token's K/V at its slot. k, v: [num_tokens, num_kv_heads, head_dim]."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, out: torch.Tensor, window: Window = META_WINDOW) -> None:
        """``out[:num_decodes]`` = attention of the decode rows of ``q`` over their cached context (its
        last ``window`` tokens where the layer's window is set)."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, span: PrefillSpan, window: int | None, scale: float,
                out: torch.Tensor) -> None:
        """``out``'s rows of ``span`` = its queries attending causally over its context (its own K/V
        already in the pools; ``k``/``v``: the batch's new K/V, rows aligned with ``q``)."""

    def step_driver(self, model: Any, kv_caches: list[KVCache]) -> StepDriver | None:
        """A driver for ``model``'s decode-only steps over these pools where this backend has one for
        its layers (asked when the model meets new pools or tensors); None: the layers run one by one."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, store: bool = True,
                window: Window = META_WINDOW) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]. Returns
        [num_tokens, num_heads, head_dim]. ``store=False``: the new tokens' K/V are already in the pools
        (the last layer stores every row's, then attends for the kept rows only). ``window``: the
        calling layer's (by default the model-wide one of ``meta``)."""
        if store:
            self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        tokens = resolve_window(window, meta)
        if meta.decode is not None:
            self.decode(q, k_cache, v_cache, meta, scale, out, tokens)
        for span in meta.prefills:
            self.prefill(q, k, v, k_cache, v_cache, span, tokens, scale, out)
        return out
