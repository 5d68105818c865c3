"""Block pool: exact block ids, ref counts and LRU free-queue order (the vLLM habit)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.block_pool import BlockPool, hash_block_key


def free_ids(pool: BlockPool) -> list[int]:
    return pool.free_order()


def test_allocates_lowest_ids_first_and_counts():
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 2
    assert free_ids(pool) == [2, 3, 4, 5]
    pool.assert_consistent()


def test_freed_blocks_join_the_tail_so_least_recently_freed_is_reused_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    assert free_ids(pool) == [2, 0]
    (again,) = pool.allocate(1)
    assert again.block_id == 2  # freed longest ago
    pool.free(reversed([blocks[1], blocks[3]]))  # a sequence's tail goes first
    assert free_ids(pool) == [0, 3, 1]
    pool.assert_consistent()


def test_shared_block_is_freed_only_when_last_reference_drops():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch(b)
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([b])
    assert b.ref_cnt == 0 and free_ids(pool) == [1, 0, 2]  # block 1 within twice the peak use, then 0
    pool.assert_consistent()


def test_touch_takes_a_free_cached_block_off_the_middle_of_the_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free(blocks)
    pool.touch(blocks[1])
    assert free_ids(pool) == [0, 2]
    assert blocks[1].ref_cnt == 1
    pool.assert_consistent()


def test_over_allocation_and_double_free_raise():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    assert pool.num_free_blocks == 2
    pool.assert_consistent()


def test_cached_hash_is_dropped_when_the_block_is_reused():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    key = (None, (1, 2, 3), None)
    h = hash_block_key(key)
    pool.cache_block(b, h, key)
    assert pool.lookup(h, key) is b
    assert pool.lookup(h, (None, (9, 9, 9), None)) is None  # a colliding hash with other tokens is a miss
    pool.free([b])
    assert pool.lookup(h, key) is b  # freed but still cached until evicted
    pool.allocate(1)
    assert pool.lookup(h, key) is None and b.block_hash is None
    pool.assert_consistent()


def test_blocks_are_created_lazily_in_id_order():
    pool = BlockPool(1_000_000)  # a huge swap pool costs nothing up front
    assert pool.num_free_blocks == 1_000_000 and len(pool._blocks) == 0
    a = pool.allocate(3)
    pool.free([a[1]])
    # Never-used blocks before freed ones while fewer than twice the peak use have been taken.
    assert pool.free_order()[:5] == [3, 4, 5, 1, 6]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]


def test_never_used_blocks_are_taken_up_to_twice_the_most_ever_in_use():
    """A pool's pages become resident as its blocks are first written: at a steady load, new prefixes
    reuse freed blocks (evicting the least recently freed) once twice the peak use has been taken."""
    pool = BlockPool(100)
    for i in range(50):  # three blocks at a time, each with a prefix of its own
        blocks = pool.allocate(3)
        for j, b in enumerate(blocks):
            key = (None, (i, j), None)
            pool.cache_block(b, hash_block_key(key), key)
        pool.free(reversed(blocks))
    assert pool.num_fresh_blocks == 94 and pool.free_order()[:6] == [2, 1, 0, 5, 4, 3]
    key = (None, (49, 0), None)
    assert pool.lookup(hash_block_key(key), key) is not None  # the latest prefixes are still cached
    burst = pool.allocate(10)  # a higher peak: never-used blocks again, up to twice the new peak
    assert [b.block_id for b in burst] == list(range(6, 16))
    pool.free(reversed(burst))
    assert [b.block_id for b in pool.allocate(10)] == [16, 17, 18, 19, 2, 1, 0, 5, 4, 3]
    pool.assert_consistent()


def test_a_pool_without_growth_limit_keeps_every_cached_prefix_until_full():
    """With a disk tier behind the pool (growth None), a cached block is evicted only once every
    never-used block has been taken: an eviction would cost a write now and a read later."""
    pool = BlockPool(20)
    pool.growth = None
    for i in range(6):
        blocks = pool.allocate(3)
        key = (None, (i,), None)
        pool.cache_block(blocks[0], hash_block_key(key), key)
        pool.free(reversed(blocks))
    assert pool.num_fresh_blocks == 2  # 18 taken, none reused
    assert all(pool.lookup(hash_block_key((None, (i,), None)), (None, (i,), None)) is not None for i in range(6))
    assert [b.block_id for b in pool.allocate(3)][:2] == [18, 19]
    pool.assert_consistent()


def _count_cached_free(pool: BlockPool) -> int:
    return sum(1 for b in pool.cached_blocks.values() if b.ref_cnt == 0)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["allocate", "free", "touch", "cache", "reset"]),
                              st.integers(0, 7)), max_size=60))
def test_free_cached_count_follows_every_operation(ops):
    """The pool keeps the number of free blocks still holding a prefix (the metrics read it every
    step); it must equal a recount after any mix of allocations, frees, cache hits, caching and
    resets, and eviction (allocating a free cached block) must lower it."""
    pool = BlockPool(6)
    held: list = []  # one entry per reference taken
    for op, arg in ops:
        if op == "allocate" and pool.num_free_blocks:
            held += pool.allocate(1 + arg % pool.num_free_blocks)
        elif op == "free" and held:
            pool.free([held.pop(arg % len(held))])
        elif op == "touch":
            cached = list(pool.cached_blocks.values())
            if cached:
                block = cached[arg % len(cached)]
                pool.touch(block)
                held.append(block)
        elif op == "cache" and pool.created_blocks:  # a held block, or a free one (its count changes at once)
            key = (None, (arg,), None)
            blocks = pool.created_blocks
            pool.cache_block(blocks[arg % len(blocks)], hash_block_key(key), key)
        elif op == "reset":
            pool.reset_prefix_cache()
        assert pool.num_cached_free_blocks == _count_cached_free(pool)
        pool.assert_consistent()
