"""The KV state snapshot (the dashboard's grid and request list) on a scheduler driven by the fake model:
every block's state, ref count, holders and hash, the swap pool, the request rows; and the palette the
page and the bench's strip share."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pagellm.entrypoints.openai
from pagellm.core.sequence import SequenceStatus
from pagellm.engine.kv_state import (
    PINNED_HOLDER,
    STATE_COLOURS,
    STATE_NAMES,
    block_state_codes,
    kv_state,
    short_hash,
)
from tests.core.fake_model import fake_step, run_to_end
from tests.core.utils import create_request, create_scheduler

PREFIX = list(range(1, 13))  # three full blocks of 4


def shared_prefix_scheduler():
    """Request a has run its prompt; b and c (same prefix, other last tokens) adopted its cached blocks."""
    sched = create_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=True, num_cpu_blocks=16)
    a = create_request(prompt_token_ids=PREFIX + [40, 41], max_tokens=6)
    sched.add_request(a)
    fake_step(sched)
    b = create_request(prompt_token_ids=PREFIX + [50], max_tokens=6, priority=3)
    c = create_request(prompt_token_ids=PREFIX + [60, 61, 62], max_tokens=6)
    sched.add_request(b)
    sched.add_request(c)
    fake_step(sched)
    return sched, a, b, c


def test_shared_prefix_blocks_are_shared_with_their_holders_ref_count_and_hash():
    sched, a, b, c = shared_prefix_scheduler()
    manager = sched.kv_cache_manager
    state = kv_state(manager, sched)
    json.dumps(state)  # JSON-able as it is
    pool = state["pool"]
    assert pool["num_blocks"] == 32 and len(pool["states"]) == 32 and pool["block_size"] == 4
    prefix_ids = manager.groups[0].block_table(a.seqs[0])[:3]
    assert manager.groups[0].block_table(b.seqs[0])[:3] == prefix_ids == manager.groups[0].block_table(c.seqs[0])[:3]
    for block_id in prefix_ids:
        assert pool["states"][block_id] == "s"
        assert pool["ref_counts"][block_id] == 3
        assert sorted(pool["holders"][block_id]) == sorted([a.request_id, b.request_id, c.request_id])
        assert pool["hashes"][block_id] == short_hash(manager.groups[0].pool.created_blocks[block_id].block_hash)
    own = manager.groups[0].block_table(c.seqs[0])[3]
    assert pool["states"][own] == "u" and own not in pool["ref_counts"] and pool["holders"][own] == [c.request_id]
    used = {b for s in (a, b, c) for b in manager.groups[0].block_table(s.seqs[0])}
    assert pool["counts"] == {"free": 32 - len(used), "used": len(used) - 3, "shared": 3, "cached": 0, "pinned": 0}
    assert state["stats"]["kv_usage"] == len(used) / 32
    assert state["stats"]["prefix_cache_hits"] == 2 * 12 and state["stats"]["prefix_cache_hit_rate"] > 0


def test_finished_requests_leave_cached_blocks_and_no_rows():
    sched, *_ = shared_prefix_scheduler()
    run_to_end(sched)
    state = kv_state(sched.kv_cache_manager, sched)
    assert state["requests"] == [] and state["pool"]["holders"] == {} and state["pool"]["ref_counts"] == {}
    states = state["pool"]["states"]
    assert set(states) <= {"f", "c"} and "c" in states
    # Cached blocks keep their hash: the next request with the prefix finds them.
    assert all(states[i] == "c" for i in state["pool"]["hashes"]) and state["pool"]["cached_hashes_sent"]


def test_request_rows_show_progress_blocks_priority_and_queue():
    sched, a, b, c = shared_prefix_scheduler()
    waiting = create_request(prompt_token_ids=[7] * 9, max_tokens=3, ttft_slo=2.0, arrival_time=100.0)
    sched.waiting.append(waiting.seqs[0])  # queued, not scheduled yet
    rows = {r["request_id"]: r for r in kv_state(sched.kv_cache_manager, sched)["requests"]}
    assert [r["queue"] for r in rows.values()] == ["running", "running", "running", "waiting"]
    ra, rb, rc, rw = rows[a.request_id], rows[b.request_id], rows[c.request_id], rows[waiting.request_id]
    assert (ra["prompt_done"], ra["prompt_tokens"], ra["generated"], ra["max_tokens"]) == (14, 14, 2, 6)
    assert rc["cached_tokens"] == 12 and rc["prompt_done"] == 15 and rc["blocks"] == 4
    assert rb["priority"] == 3 and rb["blocks"] == 4 and ra["preemptions"] == 0
    assert (rw["prompt_done"], rw["generated"], rw["blocks"]) == (0, 0, 0)
    assert rw["ttft_deadline"] == 102.0 and ra["ttft_deadline"] is None


def test_swapped_sequences_show_in_the_swap_pool_and_their_row():
    sched, a, b, c = shared_prefix_scheduler()
    out = sched.schedule()  # a step's schedule; then c is preempted by swap as the scheduler would
    sched.update(out, _samples(out))
    sched.running.remove(c.seqs[0])
    sched._preempt(c.seqs[0], out)
    assert c.seqs[0].status is SequenceStatus.SWAPPED
    state = kv_state(sched.kv_cache_manager, sched)
    cpu_table = sched.kv_cache_manager.groups[0].cpu_tables[c.seqs[0].seq_id]
    assert state["swap"]["num_blocks"] == 16
    assert state["swap"]["blocks"] == [[blk.block_id, c.request_id] for blk in cpu_table]
    row = next(r for r in state["requests"] if r["request_id"] == c.request_id)
    assert row["queue"] == "swapped" and row["swapped_blocks"] == len(cpu_table) and row["blocks"] == 0
    assert row["preemptions"] == 1 and state["stats"]["num_preemptions"] == 1
    # Its device blocks were freed: the prefix is now shared by two, its own block cached or free.
    assert state["requests"][-1]["request_id"] == c.request_id  # swapped rows after the running ones


def test_pinned_blocks_win_over_shared_and_name_the_pin():
    sched, a, *_ = shared_prefix_scheduler()
    manager = sched.kv_cache_manager
    assert manager.pin_prompt(a.seqs[0]) == 3
    state = kv_state(manager, sched)
    for block_id in manager.groups[0].block_table(a.seqs[0])[:3]:
        assert state["pool"]["states"][block_id] == "p"
        assert state["pool"]["ref_counts"][block_id] == 4
        assert PINNED_HOLDER in state["pool"]["holders"][block_id]
    assert state["pool"]["counts"]["pinned"] == 3


def test_block_state_codes_cover_the_whole_pool_untouched_blocks_free():
    sched = create_scheduler(num_blocks=10, block_size=4)
    assert block_state_codes(sched.kv_cache_manager) == "f" * 10
    sched.add_request(create_request(6, max_tokens=1))
    fake_step(sched)
    assert block_state_codes(sched.kv_cache_manager) == "f" * 10  # finished in one step, no prefix caching


def test_the_page_and_the_strip_use_one_palette():
    css = (Path(pagellm.entrypoints.openai.__file__).parent / "dashboard" / "dashboard.css").read_text()
    for code, colour in STATE_COLOURS.items():
        assert re.search(rf"--{STATE_NAMES[code]}: {colour};", css), (STATE_NAMES[code], colour)


def _samples(out):
    from pagellm.core.runner_output import ModelRunnerOutput, SampleResult

    res = ModelRunnerOutput()
    for item in out.scheduled:
        if item.sample:
            res.samples[item.seq_id] = SampleResult(token_id=3, logprob=-1.0)
    return res
