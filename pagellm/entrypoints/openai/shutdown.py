"""uvicorn's server with pagellm's shutdown: requests still running at the end of the grace period
are aborted through the engine (so each client gets a final chunk, not a cut connection), and an
engine that failed for good stops the server with a non-zero exit status."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from types import FrameType

import uvicorn

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.text import plural

logger = logging.getLogger("pagellm.server")

# uvicorn cancels the response tasks still running when its own graceful timeout expires: it gets
# this much more than --shutdown-timeout, so that the requests aborted at the end of ours have time
# to send their final chunk and [DONE] (one engine step and a few writes).
ABORT_GRACE_S = 1.0
POLL_S = 0.05


class EngineServer(uvicorn.Server):
    """``uvicorn.Server`` serving an ``AsyncLLMEngine``.

    On SIGTERM/SIGINT it waits up to ``config.timeout_graceful_shutdown`` seconds (``--shutdown-timeout``)
    for the requests in flight, then aborts the rest through the engine: streams end with
    ``finish_reason: "abort"`` and ``data: [DONE]``, non-streamed requests answer with what they have.
    When the engine fails for good it shuts down at once, and ``exit_code`` is 1.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = float(config.timeout_graceful_shutdown or 0.0)
        # (uvicorn annotates int | None, but passes it to asyncio.wait_for: any number of seconds)
        config.timeout_graceful_shutdown = self.shutdown_timeout + ABORT_GRACE_S  # type: ignore[assignment]
        self._exit_asked_at: float | None = None
        engine.fatal_callbacks.append(self._engine_failed)

    @property
    def exit_code(self) -> int:
        """1 when the engine failed (a supervisor should restart the server), else 0."""
        return 1 if self.engine.fatal_error is not None else 0

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        super().run(sockets)
        # The process exits next. Freed one by one at exit, the objects the model and torch leave
        # take seconds on a busy machine; frozen, the exit skips them and follows the last response.
        gc.freeze()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._exit_asked_at is None:  # the grace period runs from the first signal
            self._exit_asked_at = time.monotonic()
        super().handle_exit(sig, frame)

    def _engine_failed(self, error: BaseException) -> None:
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.create_task(self._abort_after_grace_period())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _abort_after_grace_period(self) -> None:
        """Wait for the requests in flight until the grace period ends, then abort the rest."""
        start = self._exit_asked_at if self._exit_asked_at is not None else time.monotonic()
        deadline = start + self.shutdown_timeout
        # uvicorn's request tasks too: a request still being read or tokenized gets its grace period.
        while self.engine.num_in_flight() or self.server_state.tasks:
            if time.monotonic() >= deadline or self.force_exit:  # force_exit: a second Ctrl-C
                aborted = self.engine.abort_all()  # and new requests are refused (503)
                logger.warning("shutdown: %s still running after %.1f s; aborted", plural(aborted, "request"),
                               self.shutdown_timeout)
                return
            await asyncio.sleep(POLL_S)
