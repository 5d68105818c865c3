"""KV cache manager: blocks on demand, exact tables, everything returned on free."""

from __future__ import annotations

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Request
from pagellm.sampling_params import SamplingParams


def make_seq(prompt_len: int, n: int = 1):
    req = Request(f"r{prompt_len}", None, list(range(prompt_len)), SamplingParams(n=n), arrival_time=0.0)
    return req.seqs[0] if n == 1 else req.seqs


def test_blocks_are_allocated_on_demand_not_for_max_len():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    seq = make_seq(5)
    assert mgr.allocate_slots(seq, 5)
    assert mgr.block_table(seq) == [0, 1]  # 5 tokens: 2 blocks, not max_model_len's worth
    seq.num_computed_tokens = 5
    assert mgr.allocate_slots(seq, 3)  # up to 8 tokens: still 2 blocks
    assert mgr.block_table(seq) == [0, 1]
    seq.num_computed_tokens = 8
    assert mgr.allocate_slots(seq, 1)
    assert mgr.block_table(seq) == [0, 1, 2]
    assert mgr.num_free_blocks == 7
    mgr.assert_consistent()


def test_allocation_fails_atomically_when_short():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a, b = make_seq(4), make_seq(3)
    assert mgr.allocate_slots(a, 4)
    assert not mgr.allocate_slots(b, 3)  # needs 2, 1 free
    assert mgr.block_table(b) == [] and mgr.num_free_blocks == 1
    mgr.assert_consistent()


def test_free_returns_every_block_tail_first():
    mgr = KVCacheManager(num_blocks=4, block_size=1)
    seq = make_seq(3)
    mgr.allocate_slots(seq, 3)
    assert mgr.free(seq) == 3
    assert [b.block_id for b in mgr.pool.free_queue] == [3, 2, 1, 0]
    assert mgr.num_free_blocks == 4 and mgr.free(seq) == 0
    mgr.assert_consistent()


def test_assert_consistent_catches_a_ref_count_drift():
    mgr = KVCacheManager(num_blocks=2, block_size=1)
    seq = make_seq(1)
    mgr.allocate_slots(seq, 1)
    mgr.pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref count"):
        mgr.assert_consistent()


@pytest.mark.parametrize("block_size", [0, 257])
def test_block_size_range(block_size):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, block_size)
