"""KV cache groups: a block pool and a block table per sequence for each kind of attention layer.

Gemma's layers alternate sliding-window attention (each query reads the last ``W`` positions) and
full attention. With one block table for every layer, a block that fell out of the sliding layers'
window cannot go back to the pool: the full-attention layers still read its positions. So the layers
are split into groups by the way they attend (vLLM's hybrid KV cache allocator, in its simplest
form): each group has a pool of its own (the cache engine gives the group's layers K/V tensors of
that pool's size), a block table per sequence, and its own prefix cache. The sliding group frees
the blocks that fall out of its window as a sequence grows (``free_out_of_window``, the stand-in
``OUT_OF_WINDOW`` keeping the table's positions), so a long sequence holds about ``W / block_size``
of its blocks while the full group holds them all.

Every operation is all-or-nothing over the groups: a sequence is admitted, continued or swapped in
only when every group can give its blocks; preemption, forks, finishing and prefix caching apply to
each group. Group 0 is the manager itself (the full-attention group), so whatever reads one pool (the
dashboard's grid, the pins' count) sees that group; ``num_blocks`` and ``num_free_blocks`` count the
blocks of every group.

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

from pagellm.core.block_pool import KVBlock
from pagellm.core.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager, KVCacheStats, cdiv, is_held
from pagellm.core.sequence import Sequence


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
        return per_seq if window is None else min(per_seq, cdiv(window, block_size) + 1)

    fit = layer_blocks // sum(blocks_per_seq(g.sliding_window) * len(g.layers) for g in groups)
    seqs = max(1, min(fit, max_num_seqs))
    step = min(per_seq, cdiv(step_tokens, block_size))
    counts = [0 if g.sliding_window is None else min(num_blocks, seqs * blocks_per_seq(g.sliding_window) + step)
              for g in groups]
    left = layer_blocks - sum(c * len(g.layers) for c, g in zip(counts, groups))
    counts[full[0]] = left // len(groups[full[0]].layers)
    return counts


def window_hit(group: KVCacheManager, seq: Sequence, limit: int) -> list[KVBlock]:
    """The table prefix of ``group`` for the longest prefix-cache hit of at most ``limit`` blocks whose
    blocks the group's layers still read are all cached: with a window, only the blocks that reach into
    the window of the hit's end (the earlier ones are ``OUT_OF_WINDOW``); without one, every block."""
    bs, window = group.block_size, group.sliding_window
    found: list[KVBlock | None] = []
    run_start = 0  # first block of the current run of cached blocks
    best = 0
    for i in range(limit):
        block = group.pool.lookup(*group.block_key(seq, i))
        found.append(block)
        if block is None:
            if window is None:
                break
            run_start = i + 1
            continue
        if run_start <= _dead_blocks(i + 1, bs, window):
            best = i + 1
    dead = _dead_blocks(best, bs, window)
    return [OUT_OF_WINDOW] * dead + [b for b in found[dead:best] if b is not None]


def _dead_blocks(num_blocks: int, block_size: int, window: int | None) -> int:
    """Leading blocks no query after ``num_blocks`` full blocks reads (``free_out_of_window``'s rule)."""
    return 0 if window is None else max(0, num_blocks * block_size - window) // block_size


class GroupHits(list[KVBlock]):
    """A prefix-cache hit in every group: group 0's blocks (the list: its length is the hit, in blocks,
    the same in each group), then the other groups' table prefixes in ``others``."""

    def __init__(self, blocks: list[KVBlock], others: list[list[KVBlock]]) -> None:
        super().__init__(blocks)
        self.others = others


class HybridKVCacheManager(KVCacheManager):
    """Block tables over several KV cache groups (see the module's docstring): this manager is group 0,
    ``extra_groups`` the others, each a plain ``KVCacheManager``."""

    def __init__(self, num_blocks: Seq[int], block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: Seq[int] | None = None, sliding_windows: Seq[int | None] = ()) -> None:
        cpu = list(num_cpu_blocks) if num_cpu_blocks is not None else [0] * len(num_blocks)
        if not len(num_blocks) == len(cpu) == len(sliding_windows) >= 2:
            raise ValueError("a hybrid KV cache needs two or more groups, each with a pool size and a window")
        super().__init__(num_blocks[0], block_size, enable_prefix_caching, num_cpu_blocks=cpu[0],
                         sliding_window=sliding_windows[0])
        self.extra_groups = tuple(
            KVCacheManager(n, block_size, enable_prefix_caching, num_cpu_blocks=c, sliding_window=w)
            for n, c, w in zip(num_blocks[1:], cpu[1:], sliding_windows[1:])
        )
        self.groups: tuple[KVCacheManager, ...] = (self, *self.extra_groups)
        self.switch_length = self._switch_length

    # Every group keys its blocks alike (the keys are memoised on the sequence, once for all groups).
    @property  # type: ignore[override]
    def switch_length(self) -> int | None:
        return self._switch_length

    @switch_length.setter
    def switch_length(self, value: int | None) -> None:
        self._switch_length = value
        for group in self.extra_groups:
            group.switch_length = value

    @property
    def num_blocks(self) -> int:
        return sum(g.pool.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.pool.num_free_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _per_group(self, cached: list[KVBlock]) -> list[list[KVBlock]]:
        if not cached:
            return [[] for _ in self.groups]
        assert isinstance(cached, GroupHits), "prefix hits of a hybrid KV cache come from its find_cached_prefix"
        return [cached, *cached.others]

    # ---------------------------------------------------------------- prefix
    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest hit valid in every group: group 0's run of cached blocks, cut to where each other
        group still has the blocks its layers read at the hit's end."""
        hits = KVCacheManager.find_cached_prefix(self, seq)
        limit = len(hits)
        while limit:
            others = [window_hit(g, seq, limit) for g in self.extra_groups]
            shortest = min(len(o) for o in others)
            if shortest == limit:
                return GroupHits(hits[:limit], others)
            limit = shortest
        return []

    def cache_full_blocks(self, seq: Sequence) -> None:
        for group in self.groups:
            KVCacheManager.cache_full_blocks(group, seq)

    def pin_prompt(self, seq: Sequence) -> int:
        """Pin group 0's cached prompt blocks and, in the other groups, those a hit on them reads."""
        n = KVCacheManager.pin_prompt(self, seq)
        for group in self.extra_groups:
            group.pin([b for b in window_hit(group, seq, n) if is_held(b)])
        return n

    def unpin_all(self) -> int:
        n = KVCacheManager.unpin_all(self)
        for group in self.extra_groups:
            group.unpin_all()
        return n

    def reset_prefix_cache(self) -> bool:
        if any(g.pool.num_used_blocks for g in self.groups):
            return False
        return all(g.pool.reset_prefix_cache() for g in self.groups)

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """``KVCacheManager.allocate_slots`` in every group, or in none (False) when one is short."""
        per_group = self._per_group(cached or [])
        plans = []
        for group, hits in zip(self.groups, per_group):
            plan = KVCacheManager.plan_slots(group, seq, num_new_tokens, hits)
            if plan[3] > group.pool.num_free_blocks:
                return False
            plans.append(plan)
        for group, hits, (computed, needed, cow_block, _) in zip(self.groups, per_group, plans):
            KVCacheManager.commit_slots(group, seq, hits, computed, needed, cow_block)
        if cached:
            seq.num_computed_tokens = plans[0][0]
        return True

    def can_admit(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock], reserve: int) -> bool:
        return all(KVCacheManager.can_admit(g, seq, num_new_tokens, hits, reserve)
                   for g, hits in zip(self.groups, self._per_group(cached)))

    def free_out_of_window(self, seq: Sequence) -> int:
        return sum(KVCacheManager.free_out_of_window(g, seq) for g in self.groups if g.sliding_window is not None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for group in self.groups:
            KVCacheManager.fork(group, parent, child)

    def free(self, seq: Sequence) -> int:
        return sum(KVCacheManager.free(g, seq) for g in self.groups)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq: Sequence) -> bool:
        if not any(map(is_held, self.block_tables.get(seq.seq_id) or ())):
            return False
        for group in self.groups:
            held = sum(1 for b in group.block_tables.get(seq.seq_id) or () if is_held(b))
            if group.cpu_pool is None or group.cpu_pool.num_free_blocks < held:
                return False
        return True

    def swap_out(self, seq: Sequence) -> int:
        return sum(KVCacheManager.swap_out(g, seq) for g in self.groups)

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        for group in self.groups:
            held = sum(1 for c in group.cpu_tables[seq.seq_id] if is_held(c))
            if held + reserve > group.pool.num_free_blocks:
                return False
        for group in self.groups:
            assert KVCacheManager.swap_in(group, seq, reserve)
        return True

    # ----------------------------------------------------------------- stats
    def stats(self, sequences: list[Sequence]) -> KVCacheStats:
        """Every group's blocks and slots together (a block of each group holds its own layers' K/V)."""
        parts = [KVCacheManager.stats(g, sequences) for g in self.groups]
        own = parts[0]

        def total(field: str) -> int:
            return sum(getattr(p, field) for p in parts)

        return KVCacheStats(
            block_size=self.block_size, total_blocks=total("total_blocks"), free_blocks=total("free_blocks"),
            in_use_blocks=total("in_use_blocks"), cached_blocks=total("cached_blocks"),
            pinned_blocks=total("pinned_blocks"), logical_tokens=total("logical_tokens"),
            physical_slots_used=total("physical_slots_used"), allocated_slots=total("allocated_slots"),
            prefix_cache_queries=own.prefix_cache_queries, prefix_cache_hits=own.prefix_cache_hits,
            peak_in_use_blocks=total("peak_in_use_blocks"),
        )

    def assert_consistent(self) -> None:
        for group in self.groups:
            KVCacheManager.assert_consistent(group)
            assert set(group.block_tables) == set(self.block_tables), "a sequence has blocks in some groups only"
            assert set(group.cpu_tables) == set(self.cpu_tables), "a sequence is swapped out in some groups only"
