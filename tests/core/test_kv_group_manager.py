"""One KV cache group's manager (kv_group_manager.py): its prefix hits with and without a window, its
plans, and what a sequence holds in it. The coordinator over groups is tested in test_kv_cache_manager
(N = 1) and test_kv_groups (N = 2)."""

from __future__ import annotations

from pagellm.core.kv_group_manager import OUT_OF_WINDOW, KVGroupManager, blocks_per_sequence, dead_blocks
from pagellm.core.sequence import Request
from pagellm.sampling_params import SamplingParams

BS = 4


def seq_of(tokens: list[int]):
    return Request("r", None, tokens, SamplingParams(), arrival_time=0.0).seqs[0]


def computed(group: KVGroupManager, tokens: list[int]):
    """A sequence whose every token is computed, its full blocks in the group's prefix cache."""
    seq = seq_of(tokens)
    plan = group.plan_slots(seq, len(tokens), [])
    group.commit_slots(seq, [], plan)
    seq.num_computed_tokens = len(tokens)
    group.cache_full_blocks(seq)
    return seq


def test_without_a_window_a_hit_is_the_run_of_cached_blocks_from_the_first():
    group = KVGroupManager(16, BS, enable_prefix_caching=True)
    first = computed(group, list(range(10, 30)))  # 5 full blocks
    group.free(first)
    other = list(range(10, 18)) + [7] * 4 + list(range(22, 31))  # its third block differs
    hit = group.usable_hit(seq_of(other), limit=5)
    assert [b.block_id for b in hit] == [0, 1]  # stops at the first miss, whatever follows
    hit = group.usable_hit(seq_of(list(range(10, 31))), limit=5)
    assert [b.block_id for b in hit] == [0, 1, 2, 3, 4]
    assert group.usable_hit(seq_of(list(range(10, 31))), limit=2) == hit[:2]


def test_with_a_window_only_the_blocks_it_reads_must_be_cached():
    window = 8
    group = KVGroupManager(16, BS, enable_prefix_caching=True, sliding_window=window)
    seq = computed(group, list(range(10, 50)))  # 10 full blocks
    group.free(seq)
    hit = group.usable_hit(seq_of(list(range(10, 51))), limit=10)
    dead = dead_blocks(10, BS, window)
    assert len(hit) == 10 and hit[:dead] == [OUT_OF_WINDOW] * dead
    assert all(b is not OUT_OF_WINDOW for b in hit[dead:])
    # A plan adopting the hit revives only the cached blocks, never the stand-ins.
    plan = group.plan_slots(seq_of(list(range(10, 51))), 1, hit)
    assert plan.computed == 40 and plan.num_free_needed == (10 - dead) + 1


def test_what_a_sequence_holds_and_what_one_may_hold():
    group = KVGroupManager(8, BS, num_cpu_blocks=8, sliding_window=6)
    seq = computed(group, list(range(10, 30)))  # 20 tokens: 5 blocks, the first 3 out of the window
    assert group.num_held_blocks(seq) == 5
    assert group.free_out_of_window(seq) == 3 and group.num_held_blocks(seq) == 2
    assert group.can_swap_out(seq) and group.swap_out(seq) == 2 and group.num_swapped_blocks(seq) == 2
    group.assert_consistent()
    assert blocks_per_sequence(100, BS, None) == 25 and blocks_per_sequence(100, BS, 6) == 3
    assert blocks_per_sequence(5, BS, 64) == 2
