"""Physical KV blocks: reference counts and an O(1) LRU free queue.

Plain Python, no torch: this layer only does bookkeeping. The tensors that hold
the K/V values live in :mod:`pagellm.worker.cache_engine`, indexed by block id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from pagellm.core.sched_output import OUT_OF_WINDOW_ID

BlockKey = tuple  # (parent_hash or None, tuple of token ids, extra keys or None)


def hash_block_key(key: BlockKey) -> int:
    """The chained prefix hash of a full block: its parent's hash, its tokens and extra keys.

    Stable across processes (128 bits of a sha256 of the key's repr, not Python's seeded ``hash``):
    the disk tier (disk_index.py) names its files by it, so that a restarted process or another one
    finds the blocks again. The key holds ints, strings, None and tuples of them, whose repr is fixed.
    """
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:16], "little")


class KVBlock:
    """One block of ``block_size`` token slots in the pool.

    ``prev_free``/``next_free`` thread the block through the free queue so that
    removing a block from the middle of the queue (a cache hit on a freed block)
    is O(1).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix hash of a full block (prefix caching); None for a block still filling.
        self.block_hash: int | None = None
        # What the hash was computed from: (parent hash, token ids, extra keys). Compared on every
        # hit, so a hash collision can never serve another prefix's K/V.
        self.block_key: BlockKey | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first (LRU order).

    Blocks are taken from the head and returned to the tail, so the block that
    has been free the longest is reused (evicted) first.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels keep every insert/remove branch-free.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not on the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def contains(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Owns every physical block: allocation, ref counts and the free queue.

    Blocks are created lazily: never-used blocks (ids ``len(self._blocks)`` and up) are
    taken in id order, ahead of the free queue while the blocks taken so far number fewer
    than ``GROWTH`` times the most ever in use at once, behind it after that. The pools'
    pages become resident as their blocks are first written (worker/cpu_tuning.py), so a
    pool's resident part follows its peak use: freed blocks keep their cached prefixes
    through a burst, but a long run of new prefixes does not walk the whole pool (and make
    all of it resident) when the load stays the same. So a large pool (the CPU swap pool)
    costs nothing up front.
    """

    # The blocks ever taken, as a multiple of the most in use at once, past which freed
    # blocks are reused (their cached prefixes evicted) before never-used ones are taken.
    GROWTH = 2

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks: list[KVBlock] = []
        self.free_queue = FreeBlockQueue(())
        # prefix hash -> block holding that full block's K/V (in use or free-but-cached).
        self.cached_blocks: dict[int, KVBlock] = {}
        # How many of those are free: kept up to date, as the metrics read it every step.
        self._num_cached_free = 0
        self._peak_used = 0
        # GROWTH, or None: every never-used block is taken before a cached one is evicted.
        self.growth: int | None = self.GROWTH
        # (block id, hash) of every cached block evicted (reused) since the last take, while recorded
        # (None: not recorded): the disk tier writes them out before the reuse overwrites them.
        self.evicted: list[tuple[int, int]] | None = None

    @property
    def blocks(self) -> list[KVBlock]:
        """Every block, by id (creates the never-used ones: for tests and checks)."""
        fresh = [KVBlock(i) for i in range(len(self._blocks), self.num_blocks)]
        for block in reversed(fresh):  # never-used blocks go ahead of every freed one
            self.free_queue.appendleft(block)
        self._blocks.extend(fresh)
        return self._blocks

    def free_order(self) -> list[int]:
        """Ids of the free blocks in the order they will be allocated (evicted), one at a time."""
        fresh = list(range(len(self._blocks), self.num_blocks))
        if self.growth is None:
            ahead = len(fresh)
        else:
            ahead = max(0, self.growth * max(self._peak_used, self.num_used_blocks + 1) - len(self._blocks))
        return fresh[:ahead] + [b.block_id for b in self.free_queue] + fresh[ahead:]

    @property
    def num_fresh_blocks(self) -> int:
        return self.num_blocks - len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.num_fresh_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the free queue (evicting cached contents) with ref count 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        self._peak_used = max(self._peak_used, self.num_used_blocks + n)
        grow_to = self.num_blocks if self.growth is None else self.growth * self._peak_used
        out = []
        for _ in range(n):
            if self.num_fresh_blocks and (not self.free_queue.num_free or len(self._blocks) < grow_to):
                block = KVBlock(len(self._blocks))
                self._blocks.append(block)
            else:
                block = self.free_queue.popleft()
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: KVBlock) -> None:
        """Take one more reference on ``block`` (a cache hit or a fork)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self._num_cached_free -= block.block_hash is not None
            self._peak_used = max(self._peak_used, self.num_used_blocks)
        block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's tail.

        Callers pass a sequence's blocks tail first, so its last blocks are evicted
        before its (possibly shared) prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self._num_cached_free += block.block_hash is not None

    def cache_block(self, block: KVBlock, block_hash: int, key: BlockKey) -> None:
        """Record that a full ``block`` holds the K/V for ``key`` (whose hash is ``block_hash``)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:  # an identical block exists already; keep the first
            return
        block.block_hash = block_hash
        block.block_key = key
        self.cached_blocks[block_hash] = block
        self._num_cached_free += block.ref_cnt == 0

    def lookup(self, block_hash: int, key: BlockKey) -> KVBlock | None:
        """The cached block for ``key``; None on a miss or on a hash collision."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.block_key != key:
            return None
        return block

    def _evict(self, block: KVBlock) -> None:
        """Forget what a free block (just taken off the queue) held."""
        if block.block_hash is not None:
            self._num_cached_free -= 1
            if self.evicted is not None:
                self.evicted.append((block.block_id, block.block_hash))
            del self.cached_blocks[block.block_hash]  # a hashed block is the one cached under it
            block.block_hash = None
            block.block_key = None

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
            block.block_key = None
        self.cached_blocks.clear()
        self._num_cached_free = 0
        return True

    @property
    def created_blocks(self) -> list[KVBlock]:
        """The blocks used at least once; the others are trivially free."""
        return self._blocks

    def assert_consistent(self) -> None:
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.free_queue.num_free, "free count drifted from the queue"
        assert len(set(free_ids)) == len(free_ids), "a block is twice on the free queue"
        assert all(i < len(self._blocks) for i in free_ids), "a never-used block is on the free queue"
        for block in self._blocks:
            on_queue = self.free_queue.contains(block)
            assert (block.ref_cnt == 0) == on_queue, f"{block}: ref count and free queue disagree"
            assert block.ref_cnt >= 0
        assert all(self.cached_blocks.get(b.block_hash) is b for b in self._blocks if b.block_hash is not None), \
            "a block carries a hash it is not cached under"
        assert self._num_cached_free == sum(1 for b in self.cached_blocks.values() if b.ref_cnt == 0), \
            "the count of free cached blocks drifted"
        for h, block in self.cached_blocks.items():
            assert block.block_hash == h, f"{block} is cached under a hash it does not carry"
            assert block.block_key is not None and hash_block_key(block.block_key) == h


# Stands in a block table for a block that fell out of the attention window and went back to the pool:
# the table keeps its logical positions, and the id (0) is one the kernels may read but never use.
OUT_OF_WINDOW = KVBlock(OUT_OF_WINDOW_ID)


def is_held(block: KVBlock) -> bool:
    """Whether a table entry holds a block of the pool (not the out-of-window stand-in)."""
    return block is not OUT_OF_WINDOW
