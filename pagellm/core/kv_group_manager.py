"""One KV cache group's block accounting: its pool, swap pool, prefix cache, pins and block tables.

Blocks are allocated as a sequence grows, shared through the prefix cache (full
blocks, found by their chained hash) and through forks (``n > 1``), copied on
the first write into a shared partial block, and pinned for preloaded prefixes.

The layers of a group attend alike (every layer of most models; Gemma's sliding layers and its
full-attention layers form two groups). ``KVCacheManager`` (kv_cache_manager.py) coordinates one
``KVGroupManager`` per group; nothing else calls these methods.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from pagellm.core.block_pool import OUT_OF_WINDOW, BlockKey, BlockPool, KVBlock, hash_block_key, is_held
from pagellm.core.kv_group_disk import GroupDiskTier
from pagellm.core.sched_output import BlockMoves
from pagellm.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheStats:
    """A memory report of the KV cache (``LLM.kv_cache_stats()``)."""

    block_size: int
    total_blocks: int
    free_blocks: int
    in_use_blocks: int
    cached_blocks: int  # free, but still holding a reusable prefix
    pinned_blocks: int
    logical_tokens: int  # K/V entries the sequences see (shared blocks counted once per holder)
    physical_slots_used: int  # slots that hold a token's K/V, each physical slot once
    allocated_slots: int  # slots of the blocks in use
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    peak_in_use_blocks: int

    @property
    def saved_by_sharing_slots(self) -> int:
        """Slots that sharing saved: what separate copies would need beyond what is used."""
        return max(0, self.logical_tokens - self.physical_slots_used)

    @property
    def internal_fragmentation(self) -> float:
        """Allocated but unused slots, as a fraction of allocated slots."""
        if not self.allocated_slots:
            return 0.0
        return (self.allocated_slots - self.physical_slots_used) / self.allocated_slots

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def blocks_per_sequence(num_tokens: int, block_size: int, window: int | None) -> int:
    """Device blocks a sequence of ``num_tokens`` holds at most in a group with this window (with one,
    those the window reaches and the block being filled)."""
    blocks = cdiv(num_tokens, block_size)
    return blocks if window is None else min(blocks, cdiv(window, block_size) + 1)


def dead_blocks(num_blocks: int, block_size: int, window: int | None) -> int:
    """Leading blocks no query after ``num_blocks`` full blocks reads (``free_out_of_window``'s rule)."""
    return 0 if window is None else max(0, num_blocks * block_size - window) // block_size


class SlotPlan(NamedTuple):
    """What ``KVGroupManager.plan_slots`` found a sequence's next tokens need in one group."""

    computed: int  # tokens computed once the prefix hits are adopted
    needed: int  # blocks to append
    cow_block: KVBlock | None  # the shared block to copy before writing into it
    num_free_needed: int  # free blocks it all takes


class KVGroupManager(GroupDiskTier):
    """Maps each sequence to its block table in one KV cache group and keeps the group's pool honest.

    With ``sliding_window`` (the group's layers attend to the last ``sliding_window`` tokens only),
    the leading blocks no later query can see go back to the pool as a sequence grows
    (``free_out_of_window``), their table entries replaced by ``OUT_OF_WINDOW``.

    Invariants (``assert_consistent``): a block's reference count is the number of block tables and
    pins holding it; free + used = total; a sequence is on the device or swapped out, never both.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0,
        sliding_window: int | None = None, switch_length: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # A longrope model's switch (phi3.longrope_switch_length): blocks of sequences past it hold
        # other keys than the same tokens' blocks of shorter sequences.
        self.switch_length = switch_length
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVBlock]] = {}
        # The swap pool in host memory, and the CPU block tables of swapped-out sequences.
        self.cpu_pool: BlockPool | None = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.cpu_tables: dict[int, list[KVBlock]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, CPU block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (CPU block, device block)
        # How many leading blocks of each sequence are registered in the prefix cache.
        self._num_hashed: dict[int, int] = {}
        self.pinned: list[KVBlock] = []
        # (src, dst) block copies that copy-on-write asked for; the scheduler hands them to the worker.
        self.pending_copies: list[tuple[int, int]] = []
        self.peak_used_blocks = 0
        self.init_disk_tier()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_sequences_with_blocks(self) -> int:
        """Sequences that hold device blocks now."""
        return sum(1 for table in self.block_tables.values() if table)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq.seq_id, ())]

    def free_out_of_window(self, seq: Sequence) -> int:
        """Return the leading blocks of ``seq`` that no query from its next token on can attend
        (every position in them at least ``sliding_window`` before it); returns how many."""
        table = self.block_tables.get(seq.seq_id)
        if self.sliding_window is None or not table:
            return 0
        dead = min(max(0, seq.num_computed_tokens - self.sliding_window) // self.block_size, len(table))
        # Stand-ins always form a prefix of the table: walk back from the last dead block to it, so a
        # step costs only the blocks it frees.
        freed = []
        i = dead - 1
        while i >= 0 and is_held(table[i]):
            freed.append(table[i])
            table[i] = OUT_OF_WINDOW
            i -= 1
        self.pool.free(freed)
        return len(freed)

    def num_revived(self, blocks: tuple[KVBlock, ...]) -> int:
        """Free blocks that holding ``blocks`` (a prefix hit) takes off the free queue."""
        return sum(1 for b in blocks if b.ref_cnt == 0 and is_held(b))

    # ---------------------------------------------------------- prefix keys
    def block_key(self, seq: Sequence, index: int) -> tuple[int, BlockKey]:
        """(hash, key) of the ``index``-th full block of ``seq``, memoised on the sequence."""
        keys = seq.block_keys
        bs = self.block_size
        while len(keys) <= index:
            i = len(keys)
            parent = keys[i - 1][0] if i else None
            # Extra keys (the cache salt; the LoRA adapter; the side of a longrope switch the sequence is
            # on) enter the first block, and through the chain all others.
            extra: object = None
            if i == 0:
                extra = seq.request.cache_salt
                lora = seq.request.lora_request
                if lora is not None:  # an adapter's K/V differ from the base model's and other adapters'
                    extra = (extra, "lora", lora.lora_name, lora.lora_path)
                if self.switch_length is not None and seq.num_tokens > self.switch_length:
                    extra = (extra, "long")
            key = (parent, tuple(seq.token_slice(i * bs, (i + 1) * bs)), extra)
            keys.append((hash_block_key(key), key))
        return keys[index]

    def usable_hit(self, seq: Sequence, limit: int) -> list[KVBlock]:
        """The table prefix of the longest prefix-cache hit of at most ``limit`` blocks whose blocks this
        group's layers still read are all cached; no side effects. Without a window, that is the run of
        cached blocks from the first; with one, only the blocks that reach into the window of the hit's
        end count (the earlier ones come back as ``OUT_OF_WINDOW`` stand-ins)."""
        if not self.enable_prefix_caching:
            return []
        bs, window = self.block_size, self.sliding_window
        found: list[KVBlock | None] = []
        run_start = 0  # first block of the current run of cached blocks
        best = 0
        for i in range(limit):
            block = self.pool.lookup(*self.block_key(seq, i))
            found.append(block)
            if block is None:
                if window is None:
                    break
                run_start = i + 1
                continue
            if run_start <= dead_blocks(i + 1, bs, window):
                best = i + 1
        dead = dead_blocks(best, bs, window)
        return [OUT_OF_WINDOW] * dead + [b for b in found[dead:best] if b is not None]

    # ------------------------------------------------------------ allocation
    def plan_slots(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]) -> SlotPlan:
        """What allocating ``num_new_tokens`` more K/V slots of ``seq`` takes (adopting the prefix hits
        ``cached`` first, for a sequence without blocks), changing nothing."""
        table = self.block_tables.get(seq.seq_id)
        assert not cached or not table, "prefix hits are only adopted by a sequence without blocks"
        held = len(table or ()) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        needed = max(0, self.blocks_for(computed + num_new_tokens) - held)
        cow_block = self._shared_block_to_write(seq, computed)
        # Free-but-cached hits leave the free queue (out-of-window stand-ins among the hits take nothing).
        revived = sum(1 for b in cached if b.ref_cnt == 0 and is_held(b))
        return SlotPlan(computed, needed, cow_block, needed + (cow_block is not None) + revived)

    def commit_slots(self, seq: Sequence, cached: list[KVBlock], plan: SlotPlan) -> None:
        """Carry out ``plan`` (the caller checked the pool has its blocks, in every group); the caller
        advances ``num_computed_tokens`` past adopted hits."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            table = self.block_tables[seq.seq_id] = []
        for block in cached:
            if is_held(block):
                self.pool.touch(block)
        table.extend(cached)
        if cached:
            self._num_hashed[seq.seq_id] = len(cached)
        if plan.cow_block is not None:
            self._copy_on_write(table, plan.computed // self.block_size)
        if plan.needed:
            table.extend(self.pool.allocate(plan.needed))
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)

    def num_blocks_to_admit(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock]) -> int:
        """Free blocks that admitting ``seq`` with these prefix hits would take."""
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        held = len(self.block_tables.get(seq.seq_id, ())) + len(cached)
        revived = sum(1 for b in cached if b.ref_cnt == 0 and is_held(b))
        return max(0, self.blocks_for(computed + num_new_tokens) - held) + revived

    def _shared_block_to_write(self, seq: Sequence, computed: int) -> KVBlock | None:
        """The partially filled block the next token goes into, if other tables hold it too."""
        if computed % self.block_size == 0:
            return None  # the next token starts a fresh block
        table = self.block_tables.get(seq.seq_id) or []
        index = computed // self.block_size
        if index < len(table) and table[index].ref_cnt > 1:
            return table[index]
        return None

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        old = table[index]
        (new,) = self.pool.allocate(1)
        self.pending_copies.append((old.block_id, new.block_id))
        table[index] = new
        self.pool.free([old])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s newly filled blocks in the prefix cache (their tokens are final)."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        done = self._num_hashed.get(seq.seq_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        for i in range(done, full):
            h, key = self.block_key(seq, i)
            if is_held(table[i]):
                self.pool.cache_block(table[i], h, key)
        self._num_hashed[seq.seq_id] = max(done, full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (partial last one included) and its progress."""
        assert child.seq_id not in self.block_tables
        table = self.block_tables.get(parent.seq_id, [])
        for block in table:
            if is_held(block):
                self.pool.touch(block)
        self.block_tables[child.seq_id] = list(table)
        self._num_hashed[child.seq_id] = self._num_hashed.get(parent.seq_id, 0)
        child.block_keys = list(parent.block_keys)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> int:
        """Return every block of ``seq`` (device and CPU); the tail goes first so a prefix outlives it."""
        self._num_hashed.pop(seq.seq_id, None)
        self.release_staged(seq.seq_id)
        cpu_table = self.cpu_tables.pop(seq.seq_id, None)
        if cpu_table and self.cpu_pool is not None:
            self.cpu_pool.free([b for b in cpu_table if is_held(b)])
        table = [b for b in self.block_tables.pop(seq.seq_id, None) or () if is_held(b)]
        if not table:
            return 0
        self.pool.free(reversed(table))
        return len(table)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ------------------------------------------------------------------ swap
    def num_held_blocks(self, seq: Sequence) -> int:
        """Device blocks ``seq`` holds in this group (out-of-window stand-ins hold none)."""
        return sum(1 for b in self.block_tables.get(seq.seq_id) or () if is_held(b))

    def num_swapped_blocks(self, seq: Sequence) -> int:
        """CPU blocks ``seq`` holds in this group's swap pool."""
        return sum(1 for c in self.cpu_tables.get(seq.seq_id) or () if is_held(c))

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= self.num_held_blocks(seq)

    def swap_out(self, seq: Sequence) -> int:
        """Move ``seq``'s blocks to the CPU pool and free its device blocks; returns the blocks moved
        (out-of-window entries stay stand-ins on the CPU side too)."""
        assert self.cpu_pool is not None
        table = self.block_tables.pop(seq.seq_id)
        held = [b for b in table if is_held(b)]
        cpu_blocks = iter(self.cpu_pool.allocate(len(held)))
        cpu_table = [next(cpu_blocks) if is_held(b) else OUT_OF_WINDOW for b in table]
        self.pending_swap_out.extend((d.block_id, c.block_id) for d, c in zip(table, cpu_table) if is_held(d))
        self.cpu_tables[seq.seq_id] = cpu_table
        # The device blocks keep their prefix hashes: their contents stay valid until reused.
        self.pool.free(reversed(held))
        self._num_hashed.pop(seq.seq_id, None)
        return len(held)

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        """Bring ``seq``'s blocks back into fresh device blocks, keeping ``reserve`` free; False if short."""
        assert self.cpu_pool is not None
        cpu_table = self.cpu_tables[seq.seq_id]
        held = [c for c in cpu_table if is_held(c)]
        if len(held) + reserve > self.pool.num_free_blocks:
            return False
        del self.cpu_tables[seq.seq_id]
        device_blocks = iter(self.pool.allocate(len(held)))
        table = [next(device_blocks) if is_held(c) else OUT_OF_WINDOW for c in cpu_table]
        self.pending_swap_in.extend((c.block_id, d.block_id) for c, d in zip(cpu_table, table) if is_held(c))
        self.cpu_pool.free(held)
        self.block_tables[seq.seq_id] = table
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return True

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, self.pending_swap_out = self.pending_swap_out, []
        into, self.pending_swap_in = self.pending_swap_in, []
        return out, into

    def take_block_moves(self) -> BlockMoves:
        """(swap out, swap in, copy): every block move asked for since the last call."""
        out, into = self.take_pending_swaps()
        return out, into, self.take_pending_copies()

    # ------------------------------------------------------------------ pins
    def pin(self, blocks: list[KVBlock]) -> None:
        """Hold ``blocks`` (a preloaded prefix) so eviction never takes them."""
        for block in blocks:
            self.pool.touch(block)
            self.pinned.append(block)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)

    def unpin_all(self) -> int:
        n = len(self.pinned)
        self.pool.free(reversed(self.pinned))
        self.pinned = []
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    # ----------------------------------------------------------------- stats
    def stats(self, sequences: list[Sequence]) -> KVCacheStats:
        bs = self.block_size
        # Every block in use is full except the tails of the tables (the last computed block, and
        # blocks allocated ahead of the computation): only those are looked at, so that the cost is
        # per sequence, not per block (the benchmarks log these stats every step). A block shared
        # by several tables (forks, prefixes) has the same fill in each.
        tails: dict[int, int] = {}
        logical = 0
        for seq in sequences:
            table = self.block_tables.get(seq.seq_id)
            if not table:
                continue
            n = seq.num_computed_tokens
            logical += n - bs * sum(1 for b in table if not is_held(b))
            for i in range(min(n // bs, len(table)), len(table)):
                tails[table[i].block_id] = max(tails.get(table[i].block_id, 0), min(bs, max(0, n - i * bs)))
        logical += bs * len(self.pinned)
        used = self.pool.num_used_blocks
        return KVCacheStats(
            block_size=bs,
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free_blocks,
            in_use_blocks=used,
            cached_blocks=self.pool.num_cached_free_blocks,
            pinned_blocks=len({b.block_id for b in self.pinned}),
            logical_tokens=logical,
            physical_slots_used=(used - len(tails)) * bs + sum(tails.values()),
            allocated_slots=used * bs,
            prefix_cache_queries=0,  # (counted once for every group, by the coordinator)
            prefix_cache_hits=0,
            peak_in_use_blocks=self.peak_used_blocks,
        )

    def assert_consistent(self) -> None:
        """Check the invariants of docs/architecture.md; raises AssertionError on a violation."""
        self.pool.assert_consistent()
        holders: Counter[int] = Counter()
        for table in self.block_tables.values():
            for block in table:
                if is_held(block):
                    holders[block.block_id] += 1
        for block in self.pinned:
            holders[block.block_id] += 1
        for blocks in self.staged.values():
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.pool.created_blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block}: ref count {block.ref_cnt} but held by {holders[block.block_id]} block tables, pins and "
                "disk reads"
            )
        used = sum(1 for b in self.pool.created_blocks if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks, "free + used != total"
        assert not set(self.block_tables) & set(self.cpu_tables), "a sequence is both on the device and swapped"
        assert not set(self.staged) & (set(self.block_tables) | set(self.cpu_tables)), \
            "a sequence holds blocks read from disk after its admission"
        if self.disk is not None:
            self.disk.assert_consistent()
        if self.cpu_pool is not None:
            self.cpu_pool.assert_consistent()
            cpu_holders = Counter(b.block_id for t in self.cpu_tables.values() for b in t if is_held(b))
            for block in self.cpu_pool.created_blocks:
                assert block.ref_cnt == cpu_holders[block.block_id], f"CPU {block}: ref count drifted"
        else:
            assert not self.cpu_tables
