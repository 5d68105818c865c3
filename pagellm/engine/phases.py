"""The engine's start-up phases: each is logged with its time, and the one running is known to the
command line, so that Ctrl-C during loading says what it interrupted instead of a traceback."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("pagellm.engine.llm_engine")

# When pagellm was first imported: the start of a command's own work (before it, only Python's).
IMPORTED_AT = time.perf_counter()
_current: str | None = None
_times: list[tuple[str, float]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Run a start-up phase (``name``: what it does, e.g. "loading the weights"), then log its time."""
    global _current
    outer, _current = _current, name
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _current = outer
    seconds = time.perf_counter() - t0
    _times.append((name, seconds))
    logger.info("start-up: %s took %.2f s", name, seconds)


def current() -> str | None:
    """The phase running now, or None."""
    return _current


def log_ready(what: str) -> None:
    """Log that ``what`` is ready, with the time since pagellm was imported and the phases' times."""
    total = time.perf_counter() - IMPORTED_AT
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in _times)
    logger.info("%s ready %.1f s after start-up began (%s)", what, total, parts or "no phases")
    _times.clear()
