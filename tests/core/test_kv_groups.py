"""KV cache groups (kv_groups.py, kv_cache_manager.py): a pool and block tables per kind of attention
layer, the sliding group freeing what falls out of its window, every operation all-or-nothing over
the groups."""

from __future__ import annotations

from pagellm.core.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager, cdiv, is_held
from pagellm.core.kv_groups import KVCacheGroupSpec, split_kv_blocks
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.core.sequence import SequenceStatus
from pagellm.distributed.step_message import decode_step, encode_step
from tests.core.fake_model import FakeClock, as_a_worker_decodes, fake_step, run_to_end
from tests.core.utils import create_request

WINDOW = 8
BS = 4


def hybrid_scheduler(full_blocks: int = 64, sliding_blocks: int = 16, cpu_blocks: int = 0, prefix: bool = False,
                     max_num_seqs: int = 8, max_model_len: int = 128, budget: int = 32,
                     **config) -> Scheduler:
    cfg = SchedulerConfig(budget, max_num_seqs, max_model_len, **config)
    kv = KVCacheManager([full_blocks, sliding_blocks], BS, prefix,
                        num_cpu_blocks=[cpu_blocks, cpu_blocks], sliding_window=[None, WINDOW])
    return Scheduler(cfg, kv, eos_token_ids=[0], clock=FakeClock())


def held(group, seq) -> int:
    return sum(1 for b in group.block_tables.get(seq.seq_id, ()) if is_held(b))


def assert_no_block_in_use(kv: KVCacheManager) -> None:
    kv.assert_consistent()
    for group in kv.groups:
        assert group.pool.num_free_blocks == group.pool.num_blocks
        assert not group.block_tables and not group.cpu_tables
    assert kv.num_free_blocks == kv.num_blocks


def test_split_gives_the_sliding_group_its_windows_and_the_full_group_the_rest():
    groups = [KVCacheGroupSpec((1, 3), None), KVCacheGroupSpec((0, 2), WINDOW)]
    full, sliding = split_kv_blocks(100, groups, BS, max_model_len=128, max_num_seqs=256, step_tokens=16)
    # Within the memory of 100 blocks of all four layers, and more full-attention blocks than that.
    assert 2 * full + 2 * sliding <= 4 * 100 and full > 100
    # Sized for the max_model_len sequences that fit: 32 + 3 blocks each, 5 of them, and a step's 4 blocks.
    assert sliding == 5 * (cdiv(WINDOW, BS) + 1) + 4
    # A window as long as the sequences frees nothing: the split is by layer count, as one table had.
    assert split_kv_blocks(100, groups, BS, max_model_len=8, max_num_seqs=256, step_tokens=16) == [100, 100]
    # max_num_seqs bounds the sliding group's share; no swap pool stays none.
    assert split_kv_blocks(100, groups, BS, 128, max_num_seqs=1, step_tokens=16)[1] == 3 + 4
    assert split_kv_blocks(0, groups, BS, 128, 256, 16) == [0, 0]


def test_a_long_sequence_holds_only_the_window_in_the_sliding_group():
    sched = hybrid_scheduler()
    kv = sched.kv_cache_manager
    full, sliding = kv.groups
    sched.add_request(request := create_request(30, max_tokens=60))
    (seq,) = request.seqs
    bound = cdiv(WINDOW, BS) + 1
    grown = []
    while sched.has_unfinished():
        fake_step(sched)  # checks every group's invariants after each step
        if seq.status is SequenceStatus.RUNNING:
            assert held(sliding, seq) <= bound
            grown.append(held(full, seq))
    assert grown == sorted(grown) and grown[-1] >= cdiv(seq.num_tokens - 2, BS)  # the full group keeps them all
    assert_no_block_in_use(kv)


def test_admission_waits_for_every_group():
    # The full group has room for both prompts, the sliding group (prompts are written whole before
    # their early blocks leave the window) for one at a time.
    sched = hybrid_scheduler(full_blocks=64, sliding_blocks=8, budget=64)
    kv = sched.kv_cache_manager
    a, b = create_request(24, max_tokens=8), create_request(24, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    assert [s.request for s in sched.running] == [a] and sched.waiting == [b.seqs[0]]
    assert not kv.holds_blocks(b.seqs[0]) and all(b.seqs[0].seq_id not in g.block_tables for g in kv.groups)
    run_to_end(sched)
    assert all(r.seqs[0].num_output_tokens == 8 for r in (a, b))
    assert_no_block_in_use(kv)


def test_preemption_by_swap_and_by_recompute_moves_every_group():
    for mode in ("swap", "recompute"):
        sched = hybrid_scheduler(full_blocks=24, sliding_blocks=12, cpu_blocks=64, preemption_mode=mode)
        kv = sched.kv_cache_manager
        requests = [create_request(20, max_tokens=40) for _ in range(3)]
        for r in requests:
            sched.add_request(r)
        moved = False
        for _ in range(500):
            if not sched.has_unfinished():
                break
            out = fake_step(sched)
            for seq_id in out.preempted_seq_ids:  # a preempted sequence holds no device block in any group
                assert all(seq_id not in g.block_tables for g in kv.groups)
                if mode == "swap":
                    assert all(seq_id in g.cpu_tables for g in kv.groups)
            if any(moves[0] or moves[1] for moves in out.block_moves):
                moved = True
        assert not sched.has_unfinished()
        assert sched.stats.num_preemptions > 0
        assert moved == (mode == "swap")
        assert all(r.seqs[0].num_output_tokens == 40 for r in requests)
        assert_no_block_in_use(kv)


def test_a_prefix_hit_needs_only_the_window_in_the_sliding_group():
    sched = hybrid_scheduler(full_blocks=64, sliding_blocks=32, prefix=True)
    kv = sched.kv_cache_manager
    prompt = list(range(10, 50))  # 40 tokens: 10 blocks
    sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=2))
    run_to_end(sched)
    again = create_request(prompt_token_ids=prompt + [7], max_tokens=2)
    hits = kv.find_cached_prefix(again.seqs[0])
    assert hits.num_blocks == 10 and all(len(blocks) == 10 for blocks in hits.blocks)
    full_hits, sliding_hits = hits.blocks
    dead = (10 * BS - WINDOW) // BS
    assert all(map(is_held, full_hits))
    assert sliding_hits[:dead] == (OUT_OF_WINDOW,) * dead and all(map(is_held, sliding_hits[dead:]))
    sched.add_request(again)
    fake_step(sched)
    assert again.seqs[0].num_cached_tokens == 40
    run_to_end(sched)
    assert_no_block_in_use(kv)
    # Once the sliding group's window blocks are gone, the hit stops where that group still has them.
    sliding = kv.groups[1]
    for block in sliding.pool.cached_blocks.copy().values():
        if block.block_key is not None and block.block_key[1] == tuple(prompt[36:40]):
            sliding.pool.allocate(sliding.pool.num_free_blocks)  # evict everything
            break
    assert not kv.find_cached_prefix(create_request(prompt_token_ids=prompt + [7]).seqs[0])


def test_forks_share_blocks_in_every_group_and_copy_on_write():
    sched = hybrid_scheduler()
    kv = sched.kv_cache_manager
    request = create_request(6, max_tokens=20, n=3)
    sched.add_request(request)
    copies = 0
    while sched.has_unfinished():
        out = fake_step(sched)
        full_copies, sliding_copies = (len(moves[2]) for moves in out.block_moves)
        copies += full_copies
        assert full_copies == sliding_copies
    assert copies > 0  # the shared partial block, copied in both groups
    assert all(s.num_output_tokens == 20 for s in request.seqs)
    assert_no_block_in_use(kv)


def test_the_step_message_carries_every_group():
    sched = hybrid_scheduler(full_blocks=24, sliding_blocks=12, cpu_blocks=64, preemption_mode="swap")
    for _ in range(3):
        sched.add_request(create_request(20, max_tokens=30))
    seen_moves = False
    while sched.has_unfinished():
        out = fake_step(sched)
        back = decode_step(encode_step(out)[1])
        assert back == as_a_worker_decodes(out)
        assert len(back.block_moves) == 2
        assert all(len(n.block_tables) == 2 for n in back.new_seqs)
        assert all(len(c.block_edits) in (0, 2) for c in back.cached_seqs)
        seen_moves |= any(any(m) for m in out.block_moves[1:])
    assert seen_moves
