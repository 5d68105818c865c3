"""Running some requests alone after a failed step: held sequences keep their state and blocks, a
reset one is recomputed from its first token, and every request still ends as it would have."""

from __future__ import annotations

from pagellm.core import step_isolation
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Request, SequenceStatus
from tests.core.fake_model import fake_step, run_to_end
from tests.core.utils import create_request, create_scheduler


def test_held_requests_wait_in_their_state_while_the_others_run_alone():
    sched = create_scheduler(num_cpu_blocks=16)
    a, b, c = running(sched, 3, max_tokens=5)  # holding blocks
    free_before = sched.kv_cache_manager.num_free_blocks
    step_isolation.hold_all_but(sched, [b])
    assert sched.held and sched.has_unfinished()
    out = fake_step(sched)
    assert [it.seq_id for it in out.scheduled] == [b.seqs[0].seq_id]
    assert a.seqs[0].num_output_tokens == 1 and b.seqs[0].num_output_tokens == 2
    assert sched.kv_cache_manager.num_free_blocks <= free_before  # held blocks stay held
    step_isolation.release(sched)
    assert not sched.held and len(sched.running) == 3
    run_to_end(sched)
    assert all(r.seqs[0].num_output_tokens == 5 for r in (a, b, c))
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def running(sched: Scheduler, count: int, max_tokens: int) -> list[Request]:
    """``count`` requests of 6 prompt tokens added to ``sched`` and prefilled."""
    requests = [create_request(6, max_tokens=max_tokens) for _ in range(count)]
    for r in requests:
        sched.add_request(r)
    fake_step(sched)
    return requests


def test_a_reset_request_is_recomputed_and_keeps_its_tokens():
    sched = create_scheduler()
    a, _ = running(sched, 2, max_tokens=6)
    fake_step(sched)
    tokens = list(a.seqs[0].output_token_ids)
    step_isolation.reset(sched, a)
    seq = a.seqs[0]
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    assert seq.output_token_ids == tokens and not sched.kv_cache_manager.groups[0].block_table(seq)
    out = fake_step(sched)  # prompt and tokens so far computed again, in one chunk
    assert any(it.seq_id == seq.seq_id and it.num_new_tokens == seq.num_tokens - 1 for it in out.scheduled)
    (new,) = [d for d in out.new_seqs if d.seq_id == seq.seq_id]  # the runner is told it whole again
    assert new.output_token_ids == tokens
    run_to_end(sched)
    assert a.seqs[0].output_token_ids[:2] == tokens and a.seqs[0].num_output_tokens == 6


def test_an_aborted_held_request_leaves_no_trace():
    sched = create_scheduler()
    a, b = running(sched, 2, max_tokens=5)
    step_isolation.hold_all_but(sched, [b])
    sched.abort_request(a)
    assert not sched.held
    step_isolation.release(sched)
    run_to_end(sched)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
