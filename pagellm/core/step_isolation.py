"""Running some requests alone: after a step that raised, the engine runs the requests of its batch
again in smaller groups (engine/step_bisection.py) while every other request waits where it is.

Both operations keep the scheduler's invariants: a reset sequence is an ordinary waiting one (as after
a preemption by recompute), and a held sequence keeps its state and blocks, out of every queue.
"""

from __future__ import annotations

from collections.abc import Collection

from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Request, SequenceStatus


def reset(scheduler: Scheduler, request: Request) -> None:
    """Send ``request``'s unfinished sequences back to be computed from their first token, their blocks
    freed: what a failed step wrote of them is in doubt. Their tokens so far are kept (the stream
    goes on where it was); forks not made yet are made again after the prompt."""
    for seq in request.seqs:
        if seq.is_finished or seq in request.pending_children:
            continue
        for queue in (scheduler.running, scheduler.swapped, scheduler.waiting, scheduler.held):
            if seq in queue:
                queue.remove(seq)
        scheduler.kv_cache_manager.free(seq)
        scheduler.runner_view.forget(seq.seq_id)  # the failed step may not have reached the runner: sent whole
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        scheduler.waiting.append(seq)
    scheduler.waiting.sort(key=scheduler.policy.key)


def hold_all_but(scheduler: Scheduler, requests: Collection[Request]) -> None:
    """Schedule only the sequences of ``requests`` until ``release``: the others leave their queues,
    keeping their state and blocks."""
    for queue in (scheduler.running, scheduler.swapped, scheduler.waiting):
        scheduler.held.extend(s for s in queue if s.request not in requests)
        queue[:] = [s for s in queue if s.request in requests]


def release(scheduler: Scheduler) -> None:
    """Every held sequence back in the queue of its state (nothing to do, and no sorting, when none is
    held: the engine loop calls this between steps)."""
    if not scheduler.held:
        return
    held, scheduler.held = scheduler.held, []
    for seq in held:
        if seq.status is SequenceStatus.RUNNING:
            scheduler.running.append(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            scheduler.swapped.append(seq)
        elif seq.status is SequenceStatus.WAITING:
            scheduler.waiting.append(seq)
    scheduler.swapped.sort(key=scheduler.policy.key)
    scheduler.waiting.sort(key=scheduler.policy.key)
