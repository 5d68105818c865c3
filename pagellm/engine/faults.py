"""Fault injection for tests: make the serving engine fail at a chosen point, the way a bug would.

Set ``PAGELLM_TEST_FAULTS`` (read by ``AsyncLLMEngine``, so a real ``pagellm serve`` honours it) to
rules separated by ``;``, each ``POINT`` or ``POINT:KEY=VALUE,KEY=VALUE``::

    PAGELLM_TEST_FAULTS="admit:prompt_contains=POISON"      # fail admitting the request with POISON in its prompt
    PAGELLM_TEST_FAULTS="step:after=3"                       # the 4th step fails inside the model run
    PAGELLM_TEST_FAULTS="step:times=inf"                     # every step fails (the engine gives up)
    PAGELLM_TEST_FAULTS="callback;abort:prompt_contains=X"   # two rules

Points:

``admit``     admitting a request into the engine's queue (``LLMEngine.enqueue``);
``abort``     aborting a request (``LLMEngine.abort_request``);
``step``      an engine step, inside the model run (after scheduling, so the batch holds new blocks);
``callback``  a step callback (the metrics hook), as if it raised;
``loop``      the engine loop itself, outside any request: always fatal.

Keys: ``prompt_contains=TEXT`` fires only for a request whose prompt text holds TEXT (a step: any
request in its batch); ``after=N`` lets the first N matching events pass; ``times=N`` fires N times
(default 1; ``inf``: every time). Unset, nothing is checked beyond one attribute test per point.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV_VAR = "PAGELLM_TEST_FAULTS"
POINTS = ("admit", "abort", "step", "callback", "loop")


class InjectedFault(RuntimeError):
    """A failure raised on purpose by a ``PAGELLM_TEST_FAULTS`` rule."""


@dataclass
class FaultRule:
    point: str
    prompt_contains: str | None = None
    after: int = 0
    times: float = 1
    seen: int = 0  # matching events so far
    fired: int = 0

    def matches(self, prompts: Iterable[str | None]) -> bool:
        if self.prompt_contains is None:
            return True
        return any(p is not None and self.prompt_contains in p for p in prompts)


class FaultInjector:
    """The parsed rules; ``check(point, prompts)`` raises ``InjectedFault`` where one fires."""

    def __init__(self, rules: list[FaultRule] | None = None) -> None:
        self.rules = rules or []
        self.points = {r.point for r in self.rules}

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """Rules from the ``PAGELLM_TEST_FAULTS`` syntax; ValueError on anything it does not know."""
        rules = []
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            point, _, options = item.partition(":")
            point = point.strip()
            if point not in POINTS:
                raise ValueError(f"{ENV_VAR}: unknown fault point {point!r} (known: {', '.join(POINTS)})")
            rule = FaultRule(point)
            for option in filter(None, (s.strip() for s in options.split(","))):
                key, eq, value = option.partition("=")
                if not eq:
                    raise ValueError(f"{ENV_VAR}: {option!r} is not KEY=VALUE")
                if key == "prompt_contains":
                    rule.prompt_contains = value
                elif key == "after":
                    rule.after = int(value)
                elif key == "times":
                    rule.times = math.inf if value == "inf" else int(value)
                else:
                    raise ValueError(f"{ENV_VAR}: unknown key {key!r} (known: prompt_contains, after, times)")
            rules.append(rule)
        return cls(rules)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls.parse(os.environ.get(ENV_VAR, ""))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def check(self, point: str, prompts: Iterable[str | None] = ()) -> None:
        """Raise ``InjectedFault`` if a rule for ``point`` fires on this event."""
        if point not in self.points:
            return
        prompts = list(prompts)
        for rule in self.rules:
            if rule.point != point or not rule.matches(prompts):
                continue
            rule.seen += 1
            if rule.seen > rule.after and rule.fired < rule.times:
                rule.fired += 1
                raise InjectedFault(f"injected fault at {point!r} ({ENV_VAR})")
