"""uvicorn's h11 protocol with a deadline for a request's head.

uvicorn closes idle keep-alive connections (``--timeout-keep-alive``) but waits forever for the
headers of a request that has begun: a client that opens connections and trickles bytes holds them
all. Here each request's head (request line and headers) must arrive within ``head_timeout``
seconds of the connection opening or of the previous response, or the connection is closed.

A request that is not valid HTTP (a bad ``Content-Length``, headers over h11's limit) is answered in
OpenAI's JSON error shape (400, or 431 for headers too large) rather than uvicorn's plain text, and
the connection is closed only after the client's remaining bytes are read (for at most
``LINGER_SECONDS``): closing a socket with unread data resets it, and the client never sees the answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagellm.entrypoints.openai.errors import error_body

LINGER_SECONDS = 2.0


class DeadlineH11Protocol(H11Protocol):
    head_timeout: float = 30.0  # set per server by ``with_head_timeout``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # answered and closing: the rest of a refused request is read and dropped
            return
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


    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused (called while handling h11's error): JSON instead."""
        exc = sys.exc_info()[1]
        status = 400
        if isinstance(exc, h11.RemoteProtocolError):
            status = exc.error_status_hint if exc.error_status_hint in (400, 413, 414, 431) else 400
        if status == 431:
            message = (f"the request's headers are larger than the server's limit of "
                       f"{getattr(self.conn, '_max_incomplete_event_size', '?')} bytes; send smaller headers")
        else:
            why = f": {exc}" if exc is not None and str(exc) else ""
            message = f"the request is not valid HTTP/1.1{why}; fix the request line and headers"
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self._disarm()
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # (h11 cannot answer in this state: close as uvicorn would)
            self.transport.close()
            return
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


def with_head_timeout(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this server's deadline."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"head_timeout": seconds})
