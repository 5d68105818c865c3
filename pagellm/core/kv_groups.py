"""KV cache groups: which layers share a block pool and block tables, and how big each group's pool is.

Gemma's layers alternate sliding-window attention (each query reads the last ``W`` positions) and
full attention. With one block table for every layer, a block that fell out of the sliding layers'
window cannot go back to the pool: the full-attention layers still read its positions. So the layers
are split into groups by the way they attend (vLLM's hybrid KV cache allocator, in its simplest
form): each group has a pool of its own (the cache engine gives the group's layers K/V tensors of
that pool's size), a block table per sequence, and its own prefix cache. The sliding group frees
the blocks that fall out of its window as a sequence grows (``free_out_of_window``, the stand-in
``OUT_OF_WINDOW`` keeping the table's positions), so a long sequence holds about ``W / block_size``
of its blocks while the full group holds them all.

``KVCacheManager`` (kv_cache_manager.py) keeps one ``KVGroupManager`` per group and runs every
operation over all of them, all or nothing. A model whose layers all attend alike has one group (with
the model's window, where every layer has the same one). The full-attention group comes first, so
whatever shows one pool (the dashboard's grid) shows that group.

Pool sizes (``split_kv_blocks``): the memory that one table per sequence would have used is split so
that both pools run out together for sequences of ``max_model_len`` tokens, the sliding group getting
what its windows need for as many of them as fit (never more than ``max_num_seqs``) plus one step's
new tokens (a prefill chunk is written whole before its early blocks leave the window), the full group
the rest. The sliding group never gets more blocks than the shared table had, so the full group never
gets fewer: long sequences gain, a batch of many short ones (shorter than the window) may fit less well.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagellm.core.kv_group_manager import blocks_per_sequence, cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers that share a pool and block tables, and how they attend."""

    layers: tuple[int, ...]
    sliding_window: int | None  # None: full attention


def split_kv_blocks(num_blocks: int, groups: Seq[KVCacheGroupSpec], block_size: int, max_model_len: int,
                    max_num_seqs: int, step_tokens: int) -> list[int]:
    """Each group's pool size, in blocks of its own layers, for the memory of ``num_blocks`` blocks of
    every layer (see the module's docstring). ``groups``: exactly one full-attention group."""
    full = [i for i, g in enumerate(groups) if g.sliding_window is None]
    if len(full) != 1:
        raise ValueError(f"KV cache groups need exactly one full-attention group, got {list(groups)}")
    if num_blocks <= 0:
        return [0] * len(groups)
    layer_blocks = num_blocks * sum(len(g.layers) for g in groups)
    per_seq = cdiv(max_model_len, block_size)

    def blocks_per_seq(window: int | None) -> int:
        return blocks_per_sequence(max_model_len, block_size, window)

    fit = layer_blocks // sum(blocks_per_seq(g.sliding_window) * len(g.layers) for g in groups)
    seqs = max(1, min(fit, max_num_seqs))
    step = min(per_seq, cdiv(step_tokens, block_size))
    counts = [0 if g.sliding_window is None else min(num_blocks, seqs * blocks_per_seq(g.sliding_window) + step)
              for g in groups]
    left = layer_blocks - sum(c * len(g.layers) for c, g in zip(counts, groups))
    counts[full[0]] = left // len(groups[full[0]].layers)
    return counts
