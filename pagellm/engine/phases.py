"""The engine's start-up phases: each is logged with its time, and the one running is known to the
command line, so that Ctrl-C during loading says what it interrupted instead of a traceback."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("pagellm.engine.llm_engine")

_current: str | None = None
_interrupted: str | None = None  # the innermost phase a Ctrl-C left
_times: list[tuple[str, float]] = []


@contextmanager
def phase(name: str, log: bool = True) -> Iterator[None]:
    """Run a start-up phase (``name``: what it does, e.g. "loading the weights"), then log its time
    (unless ``log`` is False: a phase that only names the moments between its inner ones)."""
    global _current, _interrupted
    if _current is None:  # a new start-up (another engine in this process): forget the last one's
        _times.clear()
        _interrupted = None
    outer, _current = _current, name
    t0 = time.perf_counter()
    try:
        yield
    except KeyboardInterrupt:
        _interrupted = _interrupted or name
        raise
    finally:
        _current = outer
    if log:
        seconds = time.perf_counter() - t0
        _times.append((name, seconds))
        logger.info("start-up: %s took %.2f s", name, seconds)


def current() -> str | None:
    """The phase running now (or the innermost one a Ctrl-C interrupted), or None."""
    return _current or _interrupted


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def log_ready(what: str) -> None:
    """Log that ``what`` is ready, with the time since the process started and the phases' times."""
    age = process_age()
    since = f" {age:.1f} s after the process started" if age is not None else ""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in _times)
    logger.info("%s ready%s (%s)", what, since, parts or "no start-up phases")
