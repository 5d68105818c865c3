"""StepBisection: after a step that raised, find the request whose fault it was.

A step runs a batch of requests; when it raises, the fault may be one request's (an input that
breaks a kernel) or nobody's (a broken device). Rather than fail the whole batch, its requests are
computed again from their first token (what the failed step wrote is in doubt) in halves of the
batch, every other request held where it is, halving again each group whose step fails, until a
request that fails alone is found: that one fails, the others go on as if nothing happened. A fault
that is nobody's fails every group, so every request of the batch ends up failing alone, one after
another: the async engine's "same failure in a row" rule then stops the engine.
"""

from __future__ import annotations

import logging
from collections import deque

from pagellm.core import step_isolation
from pagellm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class StepBisection:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._groups: deque[list[str]] = deque()  # groups of request ids waiting for their trial
        self._trial: list[str] | None = None  # the group running alone now

    @property
    def active(self) -> bool:
        return self._trial is not None or bool(self._groups)

    def failed(self, ids: list[str]) -> list[str]:
        """A step failed with requests ``ids`` in its batch: the requests that failed alone (fail them);
        the others are queued for trials in smaller groups."""
        if self._trial is not None:
            ids = [rid for rid in ids if rid in self._trial] or self._trial
            self._trial = None
        ids = [rid for rid in ids if rid in self.engine.requests]
        if len(ids) <= 1:
            if not self._groups:
                step_isolation.release(self.engine.scheduler)
            return ids
        for rid in ids:
            step_isolation.reset(self.engine.scheduler, self.engine.requests[rid])
        half = (len(ids) + 1) // 2
        self._groups.appendleft(ids[half:])
        self._groups.appendleft(ids[:half])
        logger.warning("an engine step with %d requests in its batch failed: running them again in groups of %d "
                       "and %d to find the one that fails", len(ids), half, len(ids) - half)
        return []

    def before_step(self) -> None:
        """Start the next trial, every other request held, if no trial runs."""
        while self._trial is None and self._groups:
            trial = [rid for rid in self._groups.popleft() if rid in self.engine.requests]  # (some ended)
            if trial:
                self._trial = trial
                step_isolation.release(self.engine.scheduler)
                step_isolation.hold_all_but(self.engine.scheduler, [self.engine.requests[rid] for rid in trial])
        if not self.active:
            step_isolation.release(self.engine.scheduler)

    def succeeded(self) -> None:
        """The step went well: the group on trial is cleared."""
        if self._trial is not None:
            self._trial = None
            if not self._groups:
                step_isolation.release(self.engine.scheduler)
