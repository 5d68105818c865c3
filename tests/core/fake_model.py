"""A fake model and clock to drive the scheduler alone, step by step."""

from __future__ import annotations

from pagellm.core.runner_output import ModelRunnerOutput, SampleResult
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler


class FakeClock:
    """Simulated time, advanced by the tests (``fake_step(..., tick=...)``)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_token(num_tokens: int) -> int:
    """The fake model's next token: a function of the position only, never EOS (0)."""
    return 1 + num_tokens % 50


def fake_step(sched: Scheduler, tick: float = 0.0) -> SchedulerOutput:
    """Schedule, 'run' the fake model, update; check the invariants; advance the clock by ``tick``."""
    out = sched.schedule()
    res = ModelRunnerOutput()
    for item in out.scheduled:
        if item.sample:
            for seq in (item.seq, *item.fork_children):
                res.samples[seq.seq_id] = SampleResult(token_id=fake_token(seq.num_tokens), logprob=-1.0)
    sched.update(out, res)
    sched.kv_cache_manager.assert_consistent()
    if tick:
        sched.clock.t += tick  # type: ignore[attr-defined]
    return out


def run_to_end(sched: Scheduler, limit: int = 1000, tick: float = 0.0) -> list[SchedulerOutput]:
    outs = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return outs
        outs.append(fake_step(sched, tick))
    raise AssertionError("scheduler did not finish: loop or deadlock")
