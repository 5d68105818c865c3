"""The KV cache of every group at once: one ``KVGroupManager`` per KV cache group, coordinated.

A model's layers form KV cache groups by the way they attend (``kv_groups.py``): most models have one
group, every layer reading the same block tables; Gemma's sliding-window and full-attention layers
form two, each with a pool, block tables and a prefix cache of its own (vLLM's hybrid KV cache
coordinator, in its simplest form). A model with one group is the case N = 1: every operation below
runs over all the groups, and there is no path of its own for the first.

Every operation is all-or-nothing over the groups: a sequence is admitted, continued or swapped in
only when every group can give its blocks; preemption, forks, finishing, pins and prefix caching
apply to each group. A prefix-cache hit is a ``KVCacheBlocks``: each group's table prefix for the
longest hit every group can serve (a sliding group needs only the blocks its window reads at the
hit's end).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagellm.core.block_pool import KVBlock
from pagellm.core.disk_index import DiskIndex
from pagellm.core.kv_group_manager import OUT_OF_WINDOW, KVCacheStats, KVGroupManager, cdiv, is_held
from pagellm.core.sched_output import BlockMoves, DiskMoves
from pagellm.core.sequence import Sequence

__all__ = ["OUT_OF_WINDOW", "KVCacheBlocks", "KVCacheManager", "KVCacheStats", "cdiv", "is_held"]


@dataclass(frozen=True)
class KVCacheBlocks:
    """A prefix-cache hit in every KV cache group: ``blocks[group][i]``, as many blocks in each group
    (a sliding group's leading entries may be ``OUT_OF_WINDOW`` stand-ins)."""

    blocks: tuple[tuple[KVBlock, ...], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0])

    def __bool__(self) -> bool:
        return self.num_blocks > 0


class KVCacheManager:
    """Block tables over the model's KV cache groups: owns one ``KVGroupManager`` per group (``groups``)
    and the prefix cache's counters, and answers for all the groups at once.

    ``num_blocks``, ``num_cpu_blocks`` and ``sliding_window`` are per group (a sequence of them), or one
    value for a model with one group. Invariants: a sequence holds blocks in every group or in none; it
    is swapped out in every group or in none; every group's own invariants hold (``assert_consistent``).
    """

    def __init__(
        self, num_blocks: int | Seq[int], block_size: int, enable_prefix_caching: bool = False,
        num_cpu_blocks: int | Seq[int] = 0, sliding_window: int | None | Seq[int | None] = None,
        switch_length: int | None = None,
    ) -> None:
        sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        cpu = [num_cpu_blocks] * len(sizes) if isinstance(num_cpu_blocks, int) else list(num_cpu_blocks)
        windows = ([sliding_window] * len(sizes) if sliding_window is None or isinstance(sliding_window, int)
                   else list(sliding_window))
        if not sizes or not len(sizes) == len(cpu) == len(windows):
            raise ValueError(f"KV cache groups need one pool size, swap pool size and window each: got {sizes}, "
                             f"{cpu} and {windows}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(KVGroupManager(n, block_size, enable_prefix_caching, num_cpu_blocks=c,
                                           sliding_window=w, switch_length=switch_length)
                            for n, c, w in zip(sizes, cpu, windows))
        self._switch_length = switch_length
        self.no_hit = KVCacheBlocks(tuple(() for _ in self.groups))
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found
        # The KV tier on disk (attach_disk): evicted cached blocks are written there and read back.
        self.disk: DiskIndex | None = None

    # A longrope model's switch (phi3.longrope_switch_length): every group keys its blocks alike (the
    # keys are memoised on the sequence, once for all groups).
    @property
    def switch_length(self) -> int | None:
        return self._switch_length

    @switch_length.setter
    def switch_length(self, value: int | None) -> None:
        self._switch_length = value
        for group in self.groups:
            group.switch_length = value

    @property
    def num_blocks(self) -> int:
        """Device blocks of every group."""
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return sum(g.cpu_pool.num_blocks for g in self.groups if g.cpu_pool is not None)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(g.pinned) for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_sequences_with_blocks(self) -> int:
        """Sequences that hold device blocks now."""
        return self.groups[0].num_sequences_with_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block table in each group, as block ids."""
        return [g.block_table(seq) for g in self.groups]

    def holds_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.groups[0].block_tables

    # ---------------------------------------------------------------- prefix
    def find_cached_prefix(self, seq: Sequence) -> KVCacheBlocks:
        """The longest prefix-cache hit for ``seq``'s tokens valid in every group; no side effects.

        A hit covers at most ``num_tokens - 1`` tokens: the last one is always computed, so there
        are logits to sample from.
        """
        return self._hit(seq, (seq.num_tokens - 1) // self.block_size)

    def _hit(self, seq: Sequence, limit: int) -> KVCacheBlocks:
        """Each group's usable hit of at most ``limit`` blocks, cut to the shortest until they agree."""
        if not self.enable_prefix_caching or limit <= 0:
            return self.no_hit
        while True:
            hits = [g.usable_hit(seq, limit) for g in self.groups]
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return KVCacheBlocks(tuple(tuple(h) for h in hits))
            limit = shortest

    def count_prefix_query(self, seq: Sequence, hit_tokens: int) -> None:
        """Prefix-cache stats, in tokens; a preempted sequence's recompute is not a query."""
        self.prefix_cache_queries += seq.num_prompt_tokens
        self.prefix_cache_hits += hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s newly filled blocks in every group's prefix cache (their tokens are final)."""
        for group in self.groups:
            group.cache_full_blocks(seq)

    def pin_prompt(self, seq: Sequence) -> int:
        """Pin, in every group, the blocks a prefix hit on ``seq``'s whole prompt reads (from its first
        block up to the first one not cached); returns the blocks pinned (every group's)."""
        hit = self._hit(seq, seq.num_prompt_tokens // self.block_size)
        pinned = 0
        for group, blocks in zip(self.groups, hit.blocks):
            held = [b for b in blocks if is_held(b)]
            group.pin(held)
            pinned += len(held)
        return pinned

    def save_pinned(self) -> int:
        """Write every group's pinned blocks to the disk tier with the next step (0 without one), so that a
        restarted engine preloads them from disk; returns the blocks to write."""
        return sum(g.save_pinned() for g in self.groups)

    def unpin_all(self) -> int:
        """Release every pin; returns the blocks released (every group's)."""
        return sum(g.unpin_all() for g in self.groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if any(g.pool.num_used_blocks for g in self.groups):
            return False
        return all([g.reset_prefix_cache() for g in self.groups])

    # -------------------------------------------------------- the disk tier
    def attach_disk(self, index: DiskIndex) -> None:
        """Write cached blocks evicted from every group to ``index``'s tier, and read prefix hits back."""
        if not self.enable_prefix_caching:
            raise ValueError("the KV tier on disk (--kv-offload-dir) needs prefix caching")
        if len(index.group_dirs) != len(self.groups):
            raise ValueError(f"the disk tier has {len(index.group_dirs)} group folders for {len(self.groups)} groups")
        self.disk = index
        for i, group in enumerate(self.groups):
            group.attach_disk(index, i)

    def has_staged(self, seq: Sequence) -> bool:
        """Whether blocks read from disk are held for ``seq`` (it waits to be admitted)."""
        return seq.seq_id in self.groups[0].staged

    @property
    def loads_in_flight(self) -> bool:
        """Whether reads from disk were asked for and their step has not reported yet."""
        return any(g.loading for g in self.groups)

    def start_disk_load(self, seq: Sequence, hit: KVCacheBlocks, reserve: int) -> int:
        """Ask for the blocks after ``hit`` that every group has on disk (not in memory) to be read into
        fresh blocks, leaving ``reserve`` free in each group; returns how many (0: none, or no room).

        ``seq`` waits: the blocks read join the prefix cache when the step reports
        (``finish_disk_loads``), held for it, and its next admission finds them as a prefix hit."""
        if self.disk is None or self.has_staged(seq):
            return 0
        start = hit.num_blocks
        limit = (seq.num_tokens - 1) // self.block_size
        count = 0
        for i in range(start, limit):
            if not all(g.on_disk(seq, i) for g in self.groups):
                break
            count += 1
        if not count or any(count + g.num_revived(blocks) + reserve > g.num_free_blocks
                            for g, blocks in zip(self.groups, hit.blocks)):
            return 0
        for group, blocks in zip(self.groups, hit.blocks):
            group.stage_loads(seq, list(blocks), count)
        return count

    def finish_disk_loads(self, failures: list[tuple[int, int]] | None) -> int:
        """Apply the runner's report of the reads asked for (``failures``: (group, block id) of those that
        failed; None: the step never reported, so every read counts as failed); returns blocks read (every
        group's)."""
        if self.disk is None or not self.loads_in_flight:
            return 0
        failed: list[set[int] | None] = [None] * len(self.groups)
        if failures is not None:
            failed = [set() for _ in self.groups]
            for group, block_id in failures:
                s = failed[group]
                assert s is not None
                s.add(block_id)
        read = [g.finish_loads(f) for g, f in zip(self.groups, failed)]
        self.disk.hit_blocks += read[0]
        return sum(read)

    def release_staged(self, keep: Sequence | None = None) -> int:
        """Drop the holds on blocks read from disk for waiting sequences other than ``keep`` (so that
        the head of the queue can use their blocks); returns the blocks released."""
        ids = {i for g in self.groups for i in g.staged} - ({keep.seq_id} if keep is not None else set())
        return sum(g.release_staged(i) for g in self.groups for i in ids)

    def take_disk_moves(self) -> list[DiskMoves]:
        """Each group's saves to, reads from and deletes in the disk tier since the last call ([] without one)."""
        if self.disk is None:
            return []
        moves = [g.take_disk_moves() for g in self.groups]
        for group, h in self.disk.take_deletes():
            moves[group].deletes.append(h)
        return moves

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: KVCacheBlocks | None = None) -> bool:
        """Make room for ``num_new_tokens`` more K/V entries of ``seq`` in every group.

        ``cached`` (for a sequence without blocks) are prefix-cache hits to adopt first; they advance
        ``num_computed_tokens``. Returns False, changing nothing, if a group's pool is short.
        """
        hits = (cached or self.no_hit).blocks
        plans = []
        for group, blocks in zip(self.groups, hits):
            plan = group.plan_slots(seq, num_new_tokens, list(blocks))
            if plan.num_free_needed > group.num_free_blocks:
                return False
            plans.append(plan)
        for group, blocks, plan in zip(self.groups, hits, plans):
            group.commit_slots(seq, list(blocks), plan)
            group.release_staged(seq.seq_id)  # (its table holds what it reads of them now)
        if cached:
            seq.num_computed_tokens = plans[0].computed
        return True

    def can_admit(self, seq: Sequence, num_new_tokens: int, cached: KVCacheBlocks, reserve: int) -> bool:
        """Whether admitting ``seq`` with these prefix hits leaves ``reserve`` blocks free in every group."""
        return all(g.num_blocks_to_admit(seq, num_new_tokens, list(blocks)) + reserve <= g.num_free_blocks
                   for g, blocks in zip(self.groups, cached.blocks))

    def free_out_of_window(self, seq: Sequence) -> int:
        """Return the blocks of ``seq`` that left its sliding groups' windows; returns how many."""
        return sum(g.free_out_of_window(seq) for g in self.groups if g.sliding_window is not None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` in every group, and its progress."""
        for group in self.groups:
            group.fork(parent, child)

    def free(self, seq: Sequence) -> int:
        """Return every block of ``seq`` (device and CPU) in every group; returns the device blocks freed."""
        return sum(g.free(seq) for g in self.groups)

    def take_block_moves(self) -> list[BlockMoves]:
        """Each group's (swap out, swap in, copy) block moves asked for since the last call."""
        return [g.take_block_moves() for g in self.groups]

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds device blocks and every group's swap pool has room for its share."""
        return any(g.num_held_blocks(seq) for g in self.groups) and all(g.can_swap_out(seq) for g in self.groups)

    def swap_out(self, seq: Sequence) -> int:
        """Move ``seq``'s blocks to the swap pools; returns the blocks moved."""
        return sum(g.swap_out(seq) for g in self.groups)

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        """Bring ``seq``'s blocks back in every group, keeping ``reserve`` free in each; False if one is short."""
        if any(g.num_swapped_blocks(seq) + reserve > g.num_free_blocks for g in self.groups):
            return False
        return all([g.swap_in(seq, reserve) for g in self.groups])

    # ----------------------------------------------------------------- stats
    def stats(self, sequences: list[Sequence]) -> KVCacheStats:
        """Every group's blocks and slots together (a block of each group holds its own layers' K/V)."""
        parts = [g.stats(sequences) for g in self.groups]

        def total(field: str) -> int:
            return sum(getattr(p, field) for p in parts)

        return KVCacheStats(
            block_size=self.block_size, total_blocks=total("total_blocks"), free_blocks=total("free_blocks"),
            in_use_blocks=total("in_use_blocks"), cached_blocks=total("cached_blocks"),
            pinned_blocks=total("pinned_blocks"), logical_tokens=total("logical_tokens"),
            physical_slots_used=total("physical_slots_used"), allocated_slots=total("allocated_slots"),
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            peak_in_use_blocks=total("peak_in_use_blocks"),
        )

    def assert_consistent(self) -> None:
        """Check every group's invariants, and that the groups agree on who holds blocks."""
        first = self.groups[0]
        for group in self.groups:
            group.assert_consistent()
            assert set(group.block_tables) == set(first.block_tables), "a sequence has blocks in some groups only"
            assert set(group.cpu_tables) == set(first.cpu_tables), "a sequence is swapped out in some groups only"
