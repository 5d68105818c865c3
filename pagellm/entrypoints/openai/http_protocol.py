"""uvicorn's h11 protocol with a deadline for a request's head.

uvicorn closes idle keep-alive connections (``--timeout-keep-alive``) but waits forever for the
headers of a request that has begun: a client that opens connections and trickles bytes holds them
all. Here each request's head (request line and headers) must arrive within ``head_timeout``
seconds of the connection opening or of the previous response, or the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class DeadlineH11Protocol(H11Protocol):
    head_timeout: float = 30.0  # set per server by ``with_head_timeout``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request's head arrived: the body has its own deadline (the app's)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head (an idle connection also meets --timeout-keep-alive)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def with_head_timeout(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this server's deadline."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"head_timeout": seconds})
