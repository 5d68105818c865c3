"""Scheduler with a fake model (deterministic tokens) and a tiny pool that forces preemption."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.core.sequence import Request, SequenceStatus
from pagellm.sampling_params import SamplingParams
from tests.core.fake_model import FakeClock, fake_step, run_to_end
from tests.core.utils import create_request, create_scheduler

_ids = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=64, chunked=True):
    return create_scheduler(num_blocks, block_size, budget, max_seqs, max_len, enable_chunked_prefill=chunked)


def make_request(prompt_len, max_tokens=4, **kw):
    return create_request(prompt_len, max_tokens, **kw)


def test_running_first_then_waiting_and_mixed_prefill_decode():
    sched = make_scheduler(budget=10)
    a = make_request(6)
    sched.add_request(a)
    first = fake_step(sched)
    assert [(s.seq_id, s.num_new_tokens) for s in first.scheduled] == [(a.seqs[0].seq_id, 6)]
    b = make_request(20)
    sched.add_request(b)
    second = fake_step(sched)
    # a decodes (1 token) first, then b's prefill takes the remaining 9 of the budget.
    assert [(s.seq_id, s.num_new_tokens) for s in second.scheduled] == [(a.seqs[0].seq_id, 1), (b.seqs[0].seq_id, 9)]
    assert second.num_batched_tokens == 10
    assert not second.scheduled[1].sample  # a prefill chunk that does not reach the end samples nothing


def test_token_budget_and_max_num_seqs_hold_every_step():
    sched = make_scheduler(budget=16, max_seqs=3, num_blocks=200)
    for n in (3, 30, 7, 12, 1, 9):
        sched.add_request(make_request(n, max_tokens=5))
    for out in run_to_end(sched):
        assert out.num_batched_tokens <= 16
        assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens
        assert len(sched.running) <= 3 and len(out.scheduled) <= 3
    assert sched.kv_cache_manager.num_free_blocks == 200


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=10, chunked=False)
    a, b = make_request(4), make_request(8)
    sched.add_request(a)
    sched.add_request(b)
    out = fake_step(sched)
    assert [s.seq_id for s in out.scheduled] == [a.seqs[0].seq_id]  # 4 + 8 > 10


def test_preempts_the_most_recently_admitted_and_recomputes_it():
    # 6 blocks of 2 tokens; three requests grow until the pool is short.
    sched = make_scheduler(num_blocks=6, block_size=2, budget=64)
    reqs = [make_request(3, max_tokens=6) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_end(sched)
    seqs = {s.seq_id: s for r in reqs for s in r.seqs}
    preempted = [seqs[i] for o in outs for i in o.preempted_seq_ids]
    assert preempted, "the tiny pool should have forced a preemption"
    assert preempted[0].request is reqs[2]  # the last admitted goes first
    assert sched.stats.num_preemptions == len(preempted)
    assert reqs[2].metrics.num_preemptions >= 1
    for r in reqs:
        (seq,) = r.seqs
        assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 6
        # The recompute regenerated exactly the same positions (the fake token is the position).
        assert seq.output_token_ids == [1 + (3 + i) % 50 for i in range(6)]
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_abort_in_every_state_returns_blocks():
    sched = make_scheduler(budget=8, num_blocks=20)
    running, chunking, waiting = make_request(2), make_request(20), make_request(3)
    for r in (running, chunking, waiting):
        sched.add_request(r)
    fake_step(sched)
    fake_step(sched)
    assert chunking.seqs[0].status is SequenceStatus.RUNNING and chunking.seqs[0].num_computed_tokens < 20
    for r in (chunking, running, waiting):
        sched.abort_request(r)
        sched.kv_cache_manager.assert_consistent()
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for r in (running, chunking, waiting) for s in r.seqs)
    assert not sched.has_unfinished() and sched.kv_cache_manager.num_free_blocks == 20


def test_stops_at_max_model_len_with_length():
    sched = make_scheduler(max_len=10)
    r = make_request(8, max_tokens=100)
    sched.add_request(r)
    run_to_end(sched)
    assert r.seqs[0].num_tokens == 10 and r.seqs[0].status is SequenceStatus.FINISHED_LENGTH


def test_first_scheduled_and_first_token_times_use_the_clock():
    sched = make_scheduler()
    r = make_request(4)
    sched.add_request(r)
    sched.clock.t = 5.0
    fake_step(sched)
    assert r.metrics.first_scheduled_time == 5.0 and r.metrics.first_token_time == 5.0
    sched.clock.t = 9.0
    run_to_end(sched)
    assert r.metrics.finished_time == 9.0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(1, 2)),
            st.tuples(st.just("step")),
            st.tuples(st.just("abort"), st.integers(0, 50)),
        ),
        max_size=60,
    ),
    block_size=st.sampled_from([1, 2, 4, 16]),
    chunked=st.booleans(),
)
def test_random_workloads_keep_invariants_and_always_finish(ops, block_size, chunked):
    max_len = 48
    num_blocks = -(-max_len // block_size) + 2  # a tiny pool: barely more than one full sequence
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=48, max_seqs=4,
                           max_len=max_len, chunked=chunked)
    live: list[Request] = []
    for op in ops:
        if op[0] == "add":
            r = make_request(op[1], max_tokens=op[2], n=op[3])
            sched.add_request(r)
            live.append(r)
        elif op[0] == "step" and sched.has_unfinished():
            fake_step(sched)
        elif op[0] == "abort" and live:
            sched.abort_request(live[op[1] % len(live)])
        manager = sched.kv_cache_manager
        manager.assert_consistent()
        assert sum(1 for b in manager.groups[0].pool.blocks if b.ref_cnt) + manager.num_free_blocks == num_blocks
    run_to_end(sched, limit=2000)
    assert all(r.is_finished for r in live)
    assert sched.kv_cache_manager.num_free_blocks == num_blocks and not sched.kv_cache_manager.groups[0].block_tables


SHARED_PREFIXES = [[7] * 12, [8, 9] * 5, list(range(20, 40))]


def _slots_holding_tokens(kv: KVCacheManager, seqs) -> int:
    """Every block's fill, by walking every table block by block (what stats() avoids)."""
    filled: dict[int, int] = {b.block_id: kv.block_size for b in kv.groups[0].pinned}
    for s in seqs:
        for i, block in enumerate(kv.groups[0].block_tables.get(s.seq_id, ())):
            n = min(kv.block_size, max(0, s.num_computed_tokens - i * kv.block_size))
            filled[block.block_id] = max(filled.get(block.block_id, 0), n)
    return sum(filled.values())


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 10), st.integers(1, 10), st.integers(1, 3)),
            st.tuples(st.just("step")),
            st.tuples(st.just("abort"), st.integers(0, 50)),
            st.tuples(st.just("pin"), st.integers(0, 2)),
            st.tuples(st.just("unpin")),
        ),
        max_size=70,
    ),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_sharing_workloads_add_fork_abort_evict_pin_keep_invariants(ops, block_size):
    """Prefix hits, forks (n > 1), aborts, evictions under a tiny pool and pins: invariants after every op."""
    max_len = 40
    num_blocks = -(-max_len // block_size) + 8
    cfg = SchedulerConfig(32, 6, max_len, enable_chunked_prefill=True)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(cfg, kv, eos_token_ids=[0], clock=FakeClock())
    live: list[Request] = []
    for op in ops:
        if op[0] == "add":
            prompt = SHARED_PREFIXES[op[1]] + [3] * op[2]
            r = Request(f"req{next(_ids)}", None, prompt[: max_len - 12],
                        SamplingParams(max_tokens=op[3], ignore_eos=True, n=op[4]), arrival_time=0.0)
            sched.add_request(r)
            live.append(r)
        elif op[0] == "step" and sched.has_unfinished():
            fake_step(sched)
        elif op[0] == "abort" and live:
            sched.abort_request(live[op[1] % len(live)])
        elif op[0] == "pin" and not kv.groups[0].pinned:
            probe = Request("probe", None, SHARED_PREFIXES[op[1]] + [0], SamplingParams(), arrival_time=0.0).seqs[0]
            (hits,) = kv.find_cached_prefix(probe).blocks
            if len(hits) + sum(1 for b in hits if b.ref_cnt == 0) <= kv.num_free_blocks:
                kv.groups[0].pin(list(hits))
        elif op[0] == "unpin":
            kv.unpin_all()
        kv.assert_consistent()
        for r in live:  # forked siblings share their blocks; no table ever holds a freed block
            for s in r.seqs:
                assert all(b.ref_cnt >= 1 for b in kv.groups[0].block_tables.get(s.seq_id, ()))
        seqs = [s for r in live for s in r.seqs]
        assert kv.stats(seqs).physical_slots_used == _slots_holding_tokens(kv, seqs)
    kv.unpin_all()
    run_to_end(sched, limit=3000)
    assert all(r.is_finished for r in live)
    for r in live:
        for s in r.seqs:
            if s.status is SequenceStatus.FINISHED_LENGTH:
                # Forks and cache hits never changed what a sequence computed (the fake token is the position).
                n = s.num_prompt_tokens
                assert s.output_token_ids == [1 + (n + i) % 50 for i in range(s.num_output_tokens)]
    assert kv.num_free_blocks == num_blocks and not kv.groups[0].block_tables
    kv.assert_consistent()
