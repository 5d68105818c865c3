"""One KV cache group's share of the KV tier on disk: its evicted cached blocks written to files, and
read back for a later prefix hit (``core/disk_index.py`` knows what is on disk; the worker's
``kv_disk_store.py`` moves the bytes).

``KVGroupManager`` takes these methods from ``GroupDiskTier``; they read its pool, tables and pins.
"""

from __future__ import annotations

from pagellm.core.block_pool import BlockKey, BlockPool, KVBlock, is_held
from pagellm.core.disk_index import DiskIndex
from pagellm.core.sched_output import DiskMoves
from pagellm.core.sequence import Sequence


class GroupDiskTier:
    """The disk tier's state and operations of one group (mixed into ``KVGroupManager``)."""

    # The group manager's, read here.
    pool: BlockPool
    pinned: list[KVBlock]
    peak_used_blocks: int

    def block_key(self, seq: Sequence, index: int) -> tuple[int, BlockKey]:
        raise NotImplementedError

    def init_disk_tier(self) -> None:
        # The KV tier on disk (attach_disk): the index of every group's files, this group's number in it.
        self.disk: DiskIndex | None = None
        self.disk_group = 0
        self.pending_loads: list[tuple[int, int]] = []  # (block hash, device block) to read this step
        self.pending_saves: list[tuple[int, int]] = []  # (device block, hash) held blocks to write (pins)
        # Blocks read from disk for a waiting sequence, held (one reference each) until it is admitted and
        # its table holds them, or it is freed: seq_id -> blocks.
        self.staged: dict[int, list[KVBlock]] = {}
        # Reads asked for and not yet confirmed by the runner: (seq_id, block, hash, key).
        self.loading: list[tuple[int, KVBlock, int, BlockKey]] = []

    # ------------------------------------------------------- the disk tier
    def attach_disk(self, index: DiskIndex, group: int) -> None:
        """Write this group's evicted cached blocks to the disk tier and read them back from it."""
        self.disk, self.disk_group = index, group
        self.pool.evicted = []
        # With a tier behind it an eviction costs a write now and a read later: the pool uses all of
        # its blocks before it evicts a cached one.
        self.pool.growth = None

    def on_disk(self, seq: Sequence, index: int) -> bool:
        """Whether the ``index``-th full block of ``seq`` is on disk and not in memory."""
        assert self.disk is not None
        h, key = self.block_key(seq, index)
        return self.pool.lookup(h, key) is None and self.disk.contains(self.disk_group, h)

    def stage_loads(self, seq: Sequence, hit: list[KVBlock], count: int) -> None:
        """Allocate blocks for the ``count`` full blocks of ``seq`` after its prefix hit ``hit`` and ask the
        runner to read them from disk (the caller checked that the pool has them); held for ``seq``, with
        the hit's blocks (which the allocation must not evict), until it is admitted or freed."""
        assert self.disk is not None and seq.seq_id not in self.staged
        held = [b for b in hit if is_held(b)]
        for block in held:
            self.pool.touch(block)
        first = len(hit)
        blocks = self.pool.allocate(count)
        for i, block in enumerate(blocks, first):
            h, key = self.block_key(seq, i)
            self.disk.touch(self.disk_group, h)
            self.pending_loads.append((h, block.block_id))
            self.loading.append((seq.seq_id, block, h, key))
        self.staged[seq.seq_id] = held + blocks
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)

    def finish_loads(self, failed: set[int] | None) -> int:
        """The runner read the blocks asked for, but those in ``failed`` (block ids; None: all failed, their
        step never reported): the blocks read join the prefix cache, still held for their sequence; a
        block that failed, and every later one of its sequence, goes back to the pool. Returns the blocks read."""
        assert self.disk is not None
        broken: set[int] = set()
        read = 0
        for seq_id, block, h, key in self.loading:
            staged = self.staged.get(seq_id)
            if staged is None:  # (freed meanwhile: its blocks went back with it)
                continue
            if failed is None or block.block_id in failed or seq_id in broken:
                if failed is not None and block.block_id in failed:
                    self.disk.discard(self.disk_group, h)
                    self.disk.failed_reads += 1
                broken.add(seq_id)
                staged.remove(block)
                self.pool.free([block])
                if not staged:
                    del self.staged[seq_id]
            else:
                self.pool.cache_block(block, h, key)
                read += 1
        self.loading = []
        return read

    def release_staged(self, seq_id: int) -> int:
        """Drop the hold on the blocks read from disk for a sequence (they stay cached); returns how many."""
        blocks = self.staged.pop(seq_id, None)
        if not blocks:
            return 0
        self.pool.free(reversed(blocks))
        return len(blocks)

    def take_disk_moves(self) -> DiskMoves:
        """This step's saves (cached blocks evicted since the last call, not on disk yet) and reads."""
        moves = DiskMoves()
        if self.disk is None:
            return moves
        evicted = self.pool.evicted
        assert evicted is not None
        for block_id, h in [*self.pending_saves, *evicted]:
            if not self.disk.has(self.disk_group, h):
                self.disk.add(self.disk_group, h)
                moves.saves.append((block_id, h))
        evicted.clear()
        self.pending_saves = []
        moves.loads, self.pending_loads = self.pending_loads, []
        return moves

    def save_pinned(self) -> int:
        """Ask for the pinned blocks not on disk yet to be written there (they hold still while pinned);
        returns how many."""
        if self.disk is None:
            return 0
        saves = {b.block_id: (b.block_id, b.block_hash) for b in self.pinned
                 if b.block_hash is not None and not self.disk.has(self.disk_group, b.block_hash)}
        self.pending_saves.extend(saves.values())
        return len(saves)

