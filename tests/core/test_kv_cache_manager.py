"""KV cache manager over one group (the case N = 1; kv_groups tests N = 2): blocks on demand, exact
tables, everything returned on free."""

from __future__ import annotations

import pytest

from pagellm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagellm.core.sequence import Request
from pagellm.sampling_params import SamplingParams


def table(mgr: KVCacheManager, seq) -> list[int]:
    """``seq``'s block ids in the one group."""
    (ids,) = mgr.block_ids(seq)
    return ids


def copies(mgr: KVCacheManager) -> list[tuple[int, int]]:
    """The copy-on-write copies asked for since the last call."""
    ((_, _, copied),) = mgr.take_block_moves()
    return copied


def ids(hits: KVCacheBlocks) -> list[int]:
    (blocks,) = hits.blocks
    return [b.block_id for b in blocks]


def make_seq(prompt_len: int, n: int = 1):
    req = Request(f"r{prompt_len}", None, list(range(prompt_len)), SamplingParams(n=n), arrival_time=0.0)
    return req.seqs[0] if n == 1 else req.seqs


def test_blocks_are_allocated_on_demand_not_for_max_len():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    seq = make_seq(5)
    assert mgr.allocate_slots(seq, 5)
    assert table(mgr, seq) == [0, 1]  # 5 tokens: 2 blocks, not max_model_len's worth
    seq.num_computed_tokens = 5
    assert mgr.allocate_slots(seq, 3)  # up to 8 tokens: still 2 blocks
    assert table(mgr, seq) == [0, 1]
    seq.num_computed_tokens = 8
    assert mgr.allocate_slots(seq, 1)
    assert table(mgr, seq) == [0, 1, 2]
    assert mgr.num_free_blocks == 7
    mgr.assert_consistent()


def test_allocation_fails_atomically_when_short():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a, b = make_seq(4), make_seq(3)
    assert mgr.allocate_slots(a, 4)
    assert not mgr.allocate_slots(b, 3)  # needs 2, 1 free
    assert table(mgr, b) == [] and mgr.num_free_blocks == 1
    mgr.assert_consistent()


def test_free_returns_every_block_tail_first():
    mgr = KVCacheManager(num_blocks=4, block_size=1)
    seq = make_seq(3)
    mgr.allocate_slots(seq, 3)
    assert mgr.free(seq) == 3
    assert mgr.groups[0].pool.free_order() == [3, 2, 1, 0]
    assert mgr.num_free_blocks == 4 and mgr.free(seq) == 0
    mgr.assert_consistent()


def test_assert_consistent_catches_a_ref_count_drift():
    mgr = KVCacheManager(num_blocks=2, block_size=1)
    seq = make_seq(1)
    mgr.allocate_slots(seq, 1)
    mgr.groups[0].pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref count"):
        mgr.assert_consistent()


# ------------------------------------------------------------ prefix caching
def make_req(tokens, salt=None, n=1):
    return Request(f"p{len(tokens)}", None, list(tokens), SamplingParams(n=n), arrival_time=0.0, cache_salt=salt)


def compute(mgr, seq, num_tokens=None):
    """Pretend the model ran: allocate and mark ``num_tokens`` (default: all) computed, then hash."""
    n = (num_tokens if num_tokens is not None else seq.num_tokens) - seq.num_computed_tokens
    assert mgr.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    mgr.cache_full_blocks(seq)


def test_prefix_hit_reuses_blocks_and_leaves_the_last_token_to_compute():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_req(range(10, 22)).seqs[0]  # 12 tokens: 3 full blocks
    compute(mgr, a)
    assert table(mgr, a) == [0, 1, 2]
    b = make_req(range(10, 22)).seqs[0]
    hits = mgr.find_cached_prefix(b)
    # 12 tokens, but at most 11 may come from the cache: 2 blocks, never the third.
    assert ids(hits) == [0, 1]
    assert mgr.allocate_slots(b, 4, hits)
    assert b.num_computed_tokens == 8 and table(mgr, b) == [0, 1, 3]
    assert [mgr.groups[0].pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    mgr.assert_consistent()


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_req([1, 2, 3, 4, 5, 6]).seqs[0]
    compute(mgr, a)
    mgr.free(a)
    assert mgr.groups[0].pool.free_order() == [3, 2, 1, 0]
    assert mgr.groups[0].pool.num_cached_free_blocks == 3
    b = make_req([1, 2, 3, 4, 9, 9]).seqs[0]
    hits = mgr.find_cached_prefix(b)
    assert ids(hits) == [0, 1]  # free-but-cached blocks are revived
    assert mgr.allocate_slots(b, 2, hits)
    # The new block came off the head of the free queue: block 3 (never cached), not the prefix.
    assert table(mgr, b) == [0, 1, 3]
    mgr.free(b)
    assert mgr.groups[0].pool.free_order() == [2, 3, 1, 0]
    c = make_req([7, 7, 7, 7]).seqs[0]
    compute(mgr, c)  # takes 2 (evicting a's cached tail block) and 3: the prefix 0, 1 survives
    assert table(mgr, c) == [2, 3]
    again = make_req([1, 2, 3, 4, 5, 6, 0]).seqs[0]
    assert ids(mgr.find_cached_prefix(again)) == [0, 1]
    mgr.assert_consistent()


def test_cache_salt_isolates_tenants_and_collisions_never_hit():
    mgr = KVCacheManager(num_blocks=10, block_size=2, enable_prefix_caching=True)
    a = make_req([1, 2, 3, 4, 5], salt="tenant-a").seqs[0]
    compute(mgr, a)
    assert not mgr.find_cached_prefix(make_req([1, 2, 3, 4, 5], salt="tenant-b").seqs[0])
    assert mgr.find_cached_prefix(make_req([1, 2, 3, 4, 5], salt="tenant-a").seqs[0]).num_blocks == 2
    # Forge a collision: the cached block's hash, but other tokens in the key.
    block = mgr.groups[0].pool.blocks[0]
    assert mgr.groups[0].pool.lookup(block.block_hash, (None, (8, 8), "tenant-a")) is None


def test_fork_shares_every_block_and_copy_on_write_copies_only_the_partial_one():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    parent, child = make_req(range(10, 20), n=2).seqs  # 10 tokens: blocks 0, 1 full, 2 partial
    compute(mgr, parent)
    mgr.fork(parent, child)
    assert table(mgr, child) == table(mgr, parent) == [0, 1, 2]
    assert all(mgr.groups[0].pool.blocks[i].ref_cnt == 2 for i in (0, 1, 2))
    parent.output_token_ids.append(50)
    child.output_token_ids.append(60)
    assert mgr.allocate_slots(child, 1)  # writes into shared block 2: copied first
    assert table(mgr, child) == [0, 1, 3] and copies(mgr) == [(2, 3)]
    assert mgr.allocate_slots(parent, 1)  # block 2 is its own now: written in place
    assert table(mgr, parent) == [0, 1, 2] and copies(mgr) == []
    assert [mgr.groups[0].pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    mgr.assert_consistent()


def test_full_blocks_are_never_copied():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    parent, child = make_req(range(10, 18), n=2).seqs  # 8 tokens: exactly 2 full blocks
    compute(mgr, parent)
    mgr.fork(parent, child)
    child.output_token_ids.append(1)
    assert mgr.allocate_slots(child, 1)
    assert table(mgr, child) == [0, 1, 2] and copies(mgr) == []


def test_pins_hold_blocks_and_count_as_holders():
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_req([1, 2, 3, 4]).seqs[0]
    compute(mgr, a)
    blocks = [mgr.groups[0].pool.blocks[0], mgr.groups[0].pool.blocks[1]]
    mgr.free(a)
    mgr.groups[0].pin(blocks)
    assert mgr.num_free_blocks == 2 and mgr.stats([]).pinned_blocks == 2
    mgr.assert_consistent()
    assert mgr.unpin_all() == 2 and mgr.num_free_blocks == 4
    mgr.assert_consistent()


def test_stats_report_sharing_and_fragmentation():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    parent, child = make_req(range(10, 20), n=2).seqs  # 10 tokens in 3 blocks (2 slots unused)
    compute(mgr, parent)
    mgr.fork(parent, child)
    st = mgr.stats([parent, child])
    assert (st.in_use_blocks, st.allocated_slots, st.physical_slots_used, st.logical_tokens) == (3, 12, 10, 20)
    assert st.saved_by_sharing_slots == 10
    assert st.internal_fragmentation == pytest.approx(2 / 12)
