"""Scheduling policies: the order of the waiting queue and who is preempted first.

Every policy is a static sort key over sequences: lower is more urgent. The waiting
(and swapped) queues are kept in key order, and the running sequence with the
highest key is the first one preempted. Keys never change while a request lives,
so two requests can never preempt each other back and forth.

- ``fcfs``: arrival order. The victim is the latest arrival.
- ``priority``: the request's ``priority`` (lower is more urgent), then arrival. When the
  most urgent waiting request does not fit, running requests that are strictly less
  urgent are preempted, least urgent first, until it fits; a request is never preempted
  for one of equal or lower urgency, and requests of equal priority are served FCFS.
- ``sla``: earliest deadline first, the deadline being arrival + ``ttft_slo`` (the request's,
  or ``--default-ttft-slo``). A request without a target goes after those with one, FCFS.
"""

from __future__ import annotations

from pagellm.core.sequence import Request, Sequence

POLICIES = ("fcfs", "priority", "sla")

SortKey = tuple


class SchedulingPolicy:
    name = "fcfs"
    # Whether a waiting request may preempt running ones to get in (only `priority` does).
    preempts_for_urgent = False

    def key(self, seq: Sequence) -> SortKey:
        return (seq.request.arrival_time, seq.seq_id)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_urgent = True

    def key(self, seq: Sequence) -> SortKey:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)


class SLAPolicy(SchedulingPolicy):
    name = "sla"

    def __init__(self, default_ttft_slo: float | None) -> None:
        self.default_ttft_slo = default_ttft_slo

    def key(self, seq: Sequence) -> SortKey:
        request = seq.request
        slo = request.ttft_slo if request.ttft_slo is not None else self.default_ttft_slo
        deadline = float("inf") if slo is None else request.arrival_time + slo
        return (deadline, request.arrival_time, seq.seq_id)


def make_policy(name: str, default_ttft_slo: float | None = None) -> SchedulingPolicy:
    if name == "fcfs":
        return SchedulingPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "sla":
        return SLAPolicy(default_ttft_slo)
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")


def met_slos(request: Request, default_ttft: float | None, default_tpot: float | None) -> bool | None:
    """Whether a finished ``request`` met its latency targets (its own, else the defaults); None without any."""
    ttft_slo = request.ttft_slo if request.ttft_slo is not None else default_ttft
    tpot_slo = request.tpot_slo if request.tpot_slo is not None else default_tpot
    if ttft_slo is None and tpot_slo is None:
        return None
    m = request.metrics
    first = m.first_token_time if m.first_token_time is not None else m.finished_time
    assert first is not None and m.finished_time is not None
    ttft = first - m.arrival_time
    n_out = max(s.num_output_tokens for s in request.seqs)
    tpot = (m.finished_time - first) / (n_out - 1) if n_out > 1 else 0.0
    return (ttft_slo is None or ttft <= ttft_slo) and (tpot_slo is None or tpot <= tpot_slo)
