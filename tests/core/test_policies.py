"""Scheduling policies, swap and abort on the scheduler alone (fake model, simulated clock)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Request, SequenceStatus
from tests.core.fake_model import fake_step, run_to_end
from tests.core.utils import create_request, create_scheduler

_ids = itertools.count()


def make(policy="fcfs", num_blocks=200, block_size=4, budget=64, max_seqs=8, max_len=128, cpu_blocks=0,
         mode="auto", **cfg):
    return create_scheduler(num_blocks, block_size, budget, max_seqs, max_len, num_cpu_blocks=cpu_blocks,
                            eos_token_ids=(), scheduling_policy=policy, preemption_mode=mode, **cfg)


def req(prompt_len, max_tokens, arrival=0.0, priority=0, ttft_slo=None, tpot_slo=None):
    return create_request(prompt_len, max_tokens, arrival_time=arrival, priority=priority, ttft_slo=ttft_slo,
                          tpot_slo=tpot_slo)


def step(sched: Scheduler):
    """One step of simulated time: every engine step takes one second."""
    return fake_step(sched, tick=1.0)


def run(sched: Scheduler, limit=2000):
    return run_to_end(sched, limit, tick=1.0)


def test_priority_request_preempts_less_urgent_work_and_gets_a_token_fast():
    steps_to_first_token = {}
    for policy in ("fcfs", "priority"):
        # 4 low-priority requests hold the whole cache: 4 x 3 blocks of 4 tokens.
        sched = make(policy, num_blocks=12, block_size=4)
        for _ in range(4):
            sched.add_request(req(8, 8, priority=10))
        for _ in range(3):
            step(sched)
        assert len(sched.running) == 4 and sched.kv_cache_manager.num_free_blocks == 0
        urgent = req(8, 4, arrival=sched.clock.t, priority=0)
        sched.add_request(urgent)
        n = 0
        while urgent.seqs[0].num_output_tokens == 0:
            step(sched)
            n += 1
        steps_to_first_token[policy] = n
        run(sched)
        assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in urgent.seqs)
        assert sched.kv_cache_manager.num_free_blocks == 12
    assert steps_to_first_token["priority"] == 1  # in the very next step
    assert steps_to_first_token["fcfs"] > 5  # waits for a running request to finish


def test_priority_never_preempts_for_equal_or_lower_urgency():
    sched = make("priority", num_blocks=6, block_size=4)
    a, b = req(8, 4, priority=1), req(8, 4, priority=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    late = req(8, 4, arrival=1.0, priority=1)
    sched.add_request(late)
    step(sched)
    assert sched.stats.num_preemptions == 0 and late.seqs[0].status is SequenceStatus.WAITING
    run(sched)
    assert late.seqs[0].status is SequenceStatus.FINISHED_LENGTH and sched.stats.num_preemptions == 0


def test_sla_policy_attains_more_than_fcfs_on_the_same_arrivals():
    attainment = {}
    for policy in ("fcfs", "sla"):
        sched = make(policy, max_seqs=2)
        loose = [req(4, 10, arrival=0.0, ttft_slo=100.0, tpot_slo=10.0) for _ in range(6)]
        for r in loose:
            sched.add_request(r)
        step(sched)
        tight = [req(4, 10, arrival=1.0, ttft_slo=15.0, tpot_slo=10.0) for _ in range(2)]
        for r in tight:
            sched.add_request(r)
        run(sched)
        attainment[policy] = sched.stats.sla_attainment
        if policy == "sla":
            assert all(r.metrics.first_token_time - r.metrics.arrival_time <= 15.0 for r in tight)
    assert attainment["fcfs"] == 6 / 8
    assert attainment["sla"] == 1.0


def test_swap_out_and_back_in_a_step_ahead_keeps_progress():
    sched = make(num_blocks=8, block_size=4, cpu_blocks=16, mode="swap")
    a, b = req(6, 20), req(6, 20)
    sched.add_request(a)
    sched.add_request(b)
    swapped_at = None
    for _ in range(200):
        out = step(sched)
        if out.block_moves[0][0] and swapped_at is None:
            swapped_at = sched.seqs_by_id[out.preempted_seq_ids[0]]
            assert swapped_at.status is SequenceStatus.SWAPPED
            computed = swapped_at.num_computed_tokens
            assert computed > 0  # swapping keeps the computed tokens
            assert len(sched.kv_cache_manager.groups[0].cpu_tables[swapped_at.seq_id]) == -(-computed // 4)
        if out.block_moves[0][1]:
            # Issued a step ahead: the sequence is running again but not computed in this step.
            (seq,) = [s for s in sched.running if s is swapped_at]
            assert all(item.seq_id != seq.seq_id for item in out.scheduled)
            break
        if not sched.has_unfinished():
            break
    assert swapped_at is not None and sched.stats.num_swap_outs >= 1 and sched.stats.num_recomputes == 0
    run(sched)
    assert a.seqs[0].output_token_ids == b.seqs[0].output_token_ids  # same prompt, same fake model
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 8 and kv.groups[0].cpu_pool.num_free_blocks == 16


def test_auto_mode_recomputes_when_the_swap_pool_is_full():
    sched = make(num_blocks=8, block_size=4, cpu_blocks=1, mode="auto")
    for _ in range(2):
        sched.add_request(req(6, 20))
    run(sched)
    assert sched.stats.num_recomputes >= 1 and sched.stats.num_swap_outs == 0


def test_abort_a_swapped_request_returns_its_cpu_blocks():
    sched = make(num_blocks=8, block_size=4, cpu_blocks=16, mode="swap")
    a, b = req(6, 20), req(6, 20)
    sched.add_request(a)
    sched.add_request(b)
    while not sched.swapped:
        step(sched)
    victim = sched.swapped[0].request
    sched.abort_request(victim)
    sched.kv_cache_manager.assert_consistent()
    assert not sched.swapped and sched.kv_cache_manager.groups[0].cpu_pool.num_free_blocks == 16
    run(sched)
    assert sched.kv_cache_manager.num_free_blocks == 8


def test_chunked_prefill_keeps_every_running_request_decoding():
    sched = make(num_blocks=400, block_size=16, budget=64, max_len=1200, max_seqs=16)
    running = [req(4, 100) for _ in range(8)]
    for r in running:
        sched.add_request(r)
    step(sched)
    long = req(1000, 2)
    sched.add_request(long)
    prefill_steps = 0
    while long.seqs[0].num_output_tokens == 0:
        before = [r.seqs[0].num_output_tokens for r in running]
        out = step(sched)
        prefill_steps += 1
        assert [r.seqs[0].num_output_tokens for r in running] == [n + 1 for n in before]
        assert out.num_batched_tokens <= 64
    assert prefill_steps == -(-1000 // (64 - 8))  # 56-token chunks around the 8 decodes


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 16), st.integers(0, 3),
                  st.booleans()),
        min_size=1, max_size=14,
    ),
    policy=st.sampled_from(["fcfs", "priority", "sla"]),
    mode=st.sampled_from(["auto", "swap", "recompute"]),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_arrivals_all_finish_or_are_refused_in_bounded_steps(arrivals, policy, mode, block_size):
    max_len = 60
    num_blocks = -(-max_len // block_size) + 3  # a tiny device pool
    sched = make(policy, num_blocks=num_blocks, block_size=block_size, budget=24, max_seqs=4, max_len=max_len,
                 cpu_blocks=num_blocks // 2, mode=mode, default_ttft_slo=5.0)
    pending = sorted(arrivals, key=lambda a: a[0])
    live: list[Request] = []
    total_tokens = sum(p + m for _, p, m, _, _ in arrivals)
    bound = 20 + 4 * total_tokens  # generous, but finite: no deadlock, no livelock
    for t in range(bound):
        while pending and pending[0][0] <= t:
            _, p, m, prio, abort = pending.pop(0)
            r = req(p, m, arrival=float(t), priority=prio)
            sched.add_request(r)
            live.append(r)
            if abort and len(live) > 1:
                sched.abort_request(live[-2])  # aborts land in every state: waiting, running, swapped
        if not pending and not sched.has_unfinished():
            break
        if sched.has_unfinished():
            step(sched)
        else:
            sched.clock.t += 1.0
    else:
        raise AssertionError(f"not done within {bound} steps")
    assert all(r.is_finished for r in live)
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    assert sched.kv_cache_manager.groups[0].cpu_pool.num_free_blocks == num_blocks // 2
    assert not sched.kv_cache_manager.groups[0].block_tables and not sched.kv_cache_manager.groups[0].cpu_tables
