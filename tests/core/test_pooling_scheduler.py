"""The pooling scheduler: whole inputs by a token budget, in arrival order, never preempted."""

from __future__ import annotations

import pytest

from pagellm.core.pooling_scheduler import PoolingInput, PoolingScheduler


def item(rid: str, n: int) -> PoolingInput:
    return PoolingInput(rid, 0, list(range(n)))


def test_short_documents_fill_the_token_budget() -> None:
    s = PoolingScheduler(max_num_batched_tokens=100, max_num_seqs=256)
    for i in range(30):
        s.add(item(str(i), 10))
    sizes = []
    while s.has_waiting():
        batch = s.schedule()
        sizes.append(sum(b.num_tokens for b in batch))
    assert sizes == [100, 100, 100]


def test_batches_keep_arrival_order_and_the_sequence_cap() -> None:
    s = PoolingScheduler(max_num_batched_tokens=1000, max_num_seqs=4)
    for i in range(6):
        s.add(item(str(i), 5))
    assert [b.request_id for b in s.schedule()] == ["0", "1", "2", "3"]
    assert [b.request_id for b in s.schedule()] == ["4", "5"]
    assert s.schedule() == []


def test_an_input_longer_than_the_budget_runs_alone() -> None:
    s = PoolingScheduler(max_num_batched_tokens=8, max_num_seqs=4)
    s.add(item("long", 20))
    s.add(item("short", 2))
    assert [b.request_id for b in s.schedule()] == ["long"]
    assert [b.request_id for b in s.schedule()] == ["short"]


def test_abort_drops_waiting_inputs() -> None:
    s = PoolingScheduler(max_num_batched_tokens=8, max_num_seqs=4)
    s.add(item("a", 2))
    s.add(item("b", 2))
    s.abort({"a"})
    assert [b.request_id for b in s.schedule()] == ["b"]


def test_needs_a_budget() -> None:
    with pytest.raises(ValueError):
        PoolingScheduler(0, 1)
