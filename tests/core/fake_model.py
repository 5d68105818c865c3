"""A fake model and clock to drive the scheduler alone, step by step; each step's output also goes to
a model runner's state and, encoded and decoded, to a tensor-parallel worker's, both checked against
the scheduler's sequences and block tables."""

from __future__ import annotations

import dataclasses
import weakref

from pagellm.core.runner_output import ModelRunnerOutput, SampleResult
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.distributed.step_message import decode_step, encode_step
from pagellm.worker.request_state import RequestStates


class FakeClock:
    """Simulated time, advanced by the tests (``fake_step(..., tick=...)``)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_token(num_tokens: int) -> int:
    """The fake model's next token: a function of the position only, never EOS (0)."""
    return 1 + num_tokens % 50


# Per scheduler: the runner's state from its outputs, and a tensor-parallel worker's from the message.
_runners: weakref.WeakKeyDictionary[Scheduler, tuple[RequestStates, RequestStates]] = weakref.WeakKeyDictionary()


def runner_states(sched: Scheduler) -> tuple[RequestStates, RequestStates]:
    """(the runner's state, a tensor-parallel worker's) as ``fake_step`` kept them for ``sched``."""
    return _runners.setdefault(sched, (RequestStates(), RequestStates()))


def as_a_worker_decodes(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` as a tensor-parallel worker decodes it: without what only rank 0 reads to sample."""
    return dataclasses.replace(
        out,
        new_seqs=[dataclasses.replace(n, sampling_params=None, seed=None) for n in out.new_seqs],
        scheduled=[dataclasses.replace(it, fork_children=[dataclasses.replace(c, seed=None) for c in it.fork_children])
                   for it in out.scheduled],
    )


def check_runner_states(sched: Scheduler, out: SchedulerOutput) -> None:
    """Apply ``out`` to the runner's state and (through the step message) a worker's: each scheduled
    sequence's tokens and block tables there are the scheduler's, and they hold no finished sequence."""
    runner, worker = runner_states(sched)
    runner.apply(out)
    worker.apply(decode_step(encode_step(out)[1]))
    kv = sched.kv_cache_manager
    for item in out.scheduled:
        seq = sched.seqs_by_id[item.seq_id]
        tables = kv.block_ids(seq)
        for states in (runner, worker):
            state = states[item.seq_id]
            assert (state.prompt_token_ids, state.output_token_ids) == (seq.prompt_token_ids, seq.output_token_ids)
            assert state.block_tables == tables, (seq, item)
        state = runner[item.seq_id]
        assert state.params is seq.params and state.seed == seq.seed
        for child in item.fork_children:
            assert runner[child.seq_id].seed == sched.seqs_by_id[child.seq_id].seed
    for states in (runner, worker):
        assert all(not sched.seqs_by_id[s.seq_id].is_finished for s in states)


def fake_step(sched: Scheduler, tick: float = 0.0) -> SchedulerOutput:
    """Schedule, 'run' the fake model, update; check the invariants; advance the clock by ``tick``."""
    out = sched.schedule()
    check_runner_states(sched, out)
    res = ModelRunnerOutput()
    for item in out.scheduled:
        if item.draft_token_ids:  # drafts are kept while they are the fake model's tokens, then one more
            n = sched.seqs_by_id[item.seq_id].num_tokens
            kept = 1
            while kept <= len(item.draft_token_ids) and item.draft_token_ids[kept - 1] == fake_token(n + kept - 1):
                kept += 1
            res.samples[item.seq_id] = SampleResult(token_id=fake_token(n), logprob=-1.0)
            res.extra_samples[item.seq_id] = [SampleResult(fake_token(n + k), -1.0) for k in range(1, kept)]
        elif item.sample:
            for seq_id in (item.seq_id, *(c.seq_id for c in item.fork_children)):
                seq = sched.seqs_by_id[seq_id]
                res.samples[seq_id] = SampleResult(token_id=fake_token(seq.num_tokens), logprob=-1.0)
    sched.update(out, res)
    sched.kv_cache_manager.assert_consistent()
    if tick:
        sched.clock.t += tick  # type: ignore[attr-defined]
    return out


def run_to_end(sched: Scheduler, limit: int = 1000, tick: float = 0.0) -> list[SchedulerOutput]:
    """Steps until every request ended; then the runner's state holds nothing once told the last ids."""
    outs = []
    for _ in range(limit):
        if not sched.has_unfinished():
            last = sched.schedule()  # (the finished ids of the last step)
            check_runner_states(sched, last)
            assert last.is_empty and not any(len(states) for states in runner_states(sched))
            return outs
        outs.append(fake_step(sched, tick))
    raise AssertionError("scheduler did not finish: loop or deadlock")
