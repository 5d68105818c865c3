"""AsyncLLMEngine: one background loop steps the engine; each request gets its own output stream.

The engine itself is not thread-safe. Steps run in a worker thread (so the event
loop keeps serving HTTP), and every change to the engine's queues (adds, aborts)
is applied by the loop between two steps, never during one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Optional

from pagellm.core.sequence import Request
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """Async iterator of one request's outputs, ending with the finished one."""

    def __init__(self, request: Request, owner: "AsyncLLMEngine") -> None:
        self.request = request
        self.request_id = request.request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._owner = owner
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request now (client gone): its blocks are freed before the next step."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


# Called after every step with the step's outputs (metrics hook).
StepCallback = Callable[[list[RequestOutput]], None]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: Optional[int] = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._step: Optional[asyncio.Future] = None
        self.step_callbacks: list[StepCallback] = []
        self.abort_callbacks: list[Callable[[Request], None]] = []

    # --------------------------------------------------------------- control
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagellm-engine-loop")

    async def stop(self) -> None:
        """Abort everything still in flight and stop the loop."""
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError("the server is shutting down"))
            self._pending_aborts.append(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._step is not None and not self._step.done():
            await asyncio.wait([self._step])  # the engine is not thread-safe: no abort during a step
        self._apply_pending()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + len(self._pending_adds)

    def num_in_flight(self) -> int:
        return len(self._streams)

    # -------------------------------------------------------------- requests
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0, **options: Any
    ) -> RequestStream:
        """Validate (ValueError on bad input) and queue; QueueFullError when the waiting queue is full."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting_requests} requests): retry later"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.engine.make_request(request_id, prompt, params, priority=priority, **options)
        stream = RequestStream(request, self)
        self._streams[request_id] = stream
        self._pending_adds.append(request)
        self._wake()
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._pending_aborts.append(request_id)
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    # ------------------------------------------------------------------ loop
    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            self.engine.enqueue(request)
        aborts, self._pending_aborts = self._pending_aborts, []
        for rid in aborts:
            request = self.engine.requests.get(rid)
            self.engine.abort_request(rid)
            if request is not None:
                for cb in self.abort_callbacks:
                    cb(request)

    async def _run(self) -> None:
        assert self._wakeup is not None
        engine = self.engine
        while True:
            if not (self._pending_adds or self._pending_aborts or engine.has_unfinished_requests()):
                self._wakeup.clear()
                await self._wakeup.wait()
            self._apply_pending()
            if not engine.has_unfinished_requests():
                for cb in self.step_callbacks:  # idle now (aborts, say): callbacks see the final state
                    cb([])
                continue
            # A task of its own, so that stop() can wait for a step still running in its thread
            # before it touches the engine.
            self._step = asyncio.ensure_future(asyncio.to_thread(engine.step))
            try:
                outputs = await asyncio.shield(self._step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not hang every client: fail them and carry on
                logger.exception("engine step failed; aborting the requests in flight")
                for rid, stream in list(self._streams.items()):
                    stream.put(EngineDeadError(f"engine step failed: {e}"))
                    self._streams.pop(rid, None)
                    self._pending_aborts.append(rid)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
            for cb in self.step_callbacks:
                cb(outputs)
            await asyncio.sleep(0)  # let handlers run between back-to-back steps
