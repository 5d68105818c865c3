"""AsyncLLMEngine: one background loop steps the engine; each request gets its own output stream.

The engine itself is not thread-safe. Steps run in a worker thread (so the event
loop keeps serving HTTP), and every change to the engine's queues (adds, aborts)
is applied by the loop between two steps, never during one.

Faults are isolated: a request that fails to be admitted fails alone; a step that raises is run
again in smaller groups until the request that fails alone is found, and only that one fails (its
blocks are freed; see step_bisection.py); a callback that raises is skipped for that step. The
same failure ``MAX_FAULTS_IN_A_ROW`` times in a row, or any error outside a request's scope, is
fatal: every request fails, ``health()`` says why and ``fatal_callbacks`` run (the server exits
non-zero there, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagellm.core.sequence import Request
from pagellm.distributed.tensor_parallel import WorkerDiedError
from pagellm.engine.faults import FaultInjector
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.engine.step_bisection import StepBisection
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.text import plural

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shutting down, or failed for good): retry on another server."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its admission, or a step it was in); the others go on."""


class TooManyFaults(RuntimeError):
    """The same part of the loop failed ``MAX_FAULTS_IN_A_ROW`` times in a row: the engine gives up."""


# A failure that keeps coming back (every step raising: a broken device, say) means the engine
# cannot serve: better a restart than a server that fails every request while /health says ok.
MAX_FAULTS_IN_A_ROW = 3


class RequestStream:
    """Async iterator of one request's outputs, ending with the finished one."""

    def __init__(self, request: Request, owner: AsyncLLMEngine) -> None:
        self.request = request
        self.request_id = request.request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._owner = owner
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
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
T = TypeVar("T")


class AsyncLLMEngine:
    """The server's engine loop: owns the ``LLMEngine``, one output stream per request, and the fault
    guard. Adds and aborts are queued by the event loop and applied between two steps; steps run on
    one long-lived thread; a fault fails the requests it is found to be (see the module docstring).
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 faults: FaultInjector | None = None) -> None:
        """``faults``: test-only fault injection (default: the rules in ``$PAGELLM_TEST_FAULTS``, if any)."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        # Aborted by abort_all: these streams get the request's final output (finish_reason "abort").
        self._final_on_abort: dict[str, RequestStream] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._step: asyncio.Future | None = None
        # Every step on one long-lived thread: glibc gives each thread its own malloc arena, and
        # keep_freed_memory (worker/cpu_tuning.py) lets each arena keep what a step freed, so steps
        # spread over a rotating pool of threads would each grow an arena of their own.
        self._step_thread: ThreadPoolExecutor | None = None
        self._closing = False
        self._faults_in_a_row: dict[Hashable, int] = {}
        # Reads of the engine's state asked for while a step ran (read_between_steps): served after it.
        self._pending_reads: list[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = []
        self.step_callbacks: list[StepCallback] = []
        self.abort_callbacks: list[Callable[[Request], None]] = []
        # Called once, with the error, when the engine fails for good (the server exits on it).
        self.fatal_callbacks: list[Callable[[BaseException], None]] = []
        self.fatal_error: BaseException | None = None
        self._bisection = StepBisection(engine)
        self.faults = FaultInjector.from_env() if faults is None else faults
        if "step" in self.faults.points:
            self._inject_step_faults()

    # --------------------------------------------------------------- control
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagellm-engine-loop")

    async def stop(self) -> None:
        """Abort everything still in flight and stop the loop."""
        self._closing = True
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError("the server is shutting down"))
            self._pending_aborts.append(rid)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._step is not None and not self._step.done():
            await asyncio.wait([self._step])  # the engine is not thread-safe: no abort during a step
        self._serve_reads()
        # Whatever is left in the engine too (requests a dead loop failed): their blocks come back.
        self._pending_aborts.extend(self.engine.requests)  # a second abort of one is a no-op
        try:
            self._apply_pending()
        except Exception as e:  # after a fatal failure the engine may be beyond repair: nothing to save
            logger.warning("could not abort every request while stopping: %s: %s", type(e).__name__, e)
        for stream in self._final_on_abort.values():
            stream.put(EngineDeadError("the server is shutting down"))
        self._final_on_abort.clear()
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=False)
            self._step_thread = None
        self.engine.shutdown()

    def abort_all(self) -> int:
        """Abort every request in flight and refuse new ones (a shutdown whose grace period is over).

        Each stream ends with its request's final output, the unfinished samples with finish_reason
        "abort", so clients see a proper end rather than a cut connection. Returns how many.
        """
        self._closing = True
        rids = list(self._streams)
        for rid in rids:
            self._final_on_abort[rid] = self._streams.pop(rid)
            self._pending_aborts.append(rid)
        self._wake()
        return len(rids)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def health(self) -> str | None:
        """None while the engine serves; otherwise why it does not (for /health)."""
        if self.fatal_error is not None:
            return f"the engine failed: {self.fatal_error}"
        if self._closing:
            return "the server is shutting down"
        if not self.is_running:
            return "the engine loop is not running"
        if self.engine.tensor_parallel is not None:
            try:
                self.engine.tensor_parallel.check_workers()
            except WorkerDiedError as e:
                return str(e)
        return None

    async def read_between_steps(self, read: Callable[[LLMEngine], T]) -> T:
        """``read(engine)`` while no step runs: at once when the engine is between steps, else right
        after the step in flight, before the next one starts (the dashboard's snapshot of the KV cache).

        ``read`` runs on the event loop, so it must be quick and must not change the engine.
        """
        if self._step is None or self._step.done():
            # No step in flight: queues and blocks change only on this thread now (adds and aborts
            # are applied by the loop, which is waiting while this runs).
            return read(self.engine)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_reads.append((read, future))
        return await future

    def _serve_reads(self) -> None:
        reads, self._pending_reads = self._pending_reads, []
        for read, future in reads:
            if future.done():  # its reader stopped waiting
                continue
            try:
                future.set_result(read(self.engine))
            except Exception as e:
                future.set_exception(e)

    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + len(self._pending_adds)

    def num_in_flight(self) -> int:
        return len(self._streams)

    # -------------------------------------------------------------- requests
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0, **options: Any
    ) -> RequestStream:
        """Validate (ValueError on bad input) and queue; QueueFullError when the waiting queue is full."""
        if not self.is_running or self._closing:
            raise EngineDeadError(self.health() or "the engine loop is not running")
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({plural(self.max_waiting_requests, 'request')}): retry later"
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
            self._admit(request)
        aborts, self._pending_aborts = self._pending_aborts, []
        for rid in aborts:
            self._abort_now(rid)

    def _admit(self, request: Request) -> None:
        """Queue one request in the engine; a failure fails this request alone."""
        rid = request.request_id
        try:
            self.faults.check("admit", (request.prompt,))
            self.engine.enqueue(request)
        except Exception as e:
            logger.error("admitting request %s failed; it alone fails", rid, exc_info=e)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(RequestFailedError(f"the engine could not admit this request: {type(e).__name__}: {e}"))
            if self.engine.requests.get(rid) is request:  # enqueue got halfway: take back what it left
                self._pending_aborts.append(rid)

    def _abort_now(self, rid: str) -> None:
        """Abort one request in the engine; one that fails is retried before the next step (its
        blocks must come back), and is fatal after MAX_FAULTS_IN_A_ROW tries."""
        request = self.engine.requests.get(rid)
        try:
            if request is not None:
                self.faults.check("abort", (request.prompt,))
            self.engine.abort_request(rid)
        except Exception as e:
            self._pending_aborts.append(rid)
            self._fault("abort", e, f"aborting request {rid}")
            return
        self._fault_cleared("abort")
        stream = self._final_on_abort.pop(rid, None)
        if stream is not None:
            # The engine's own output builder: the request's text so far, its samples now "abort"
            # (or, had it finished meanwhile, its real ending).
            stream.put(self.engine.make_output(request if request is not None else stream.request))
        if request is not None:
            for cb in self.abort_callbacks:
                self._call(cb, request)

    def _call(self, cb: Callable[[Any], None], arg: Any, fault_point: str | None = None) -> None:
        """A callback (metrics) that raises is skipped this time; the requests are not its concern."""
        try:
            if fault_point is not None:
                self.faults.check(fault_point)
            cb(arg)
        except Exception as e:
            self._fault(cb, e, f"callback {getattr(cb, '__qualname__', cb)!s}")
        else:
            self._fault_cleared(cb)

    def _fault(self, key: Hashable, error: BaseException, what: str) -> None:
        """Log a failure the engine survives; the same one MAX_FAULTS_IN_A_ROW times in a row is fatal.

        The first of a run is logged with its traceback, the repeats in one line each.
        """
        n = self._faults_in_a_row.get(key, 0) + 1
        self._faults_in_a_row[key] = n
        if n == 1:
            logger.error("%s failed; the engine goes on", what, exc_info=error)
        else:
            logger.error("%s failed again (%d in a row): %s: %s", what, n, type(error).__name__, error)
        if n >= MAX_FAULTS_IN_A_ROW:
            raise TooManyFaults(f"{what} failed {n} times in a row (last: {type(error).__name__}: {error})")

    def _fault_cleared(self, key: Hashable) -> None:
        if self._faults_in_a_row:
            self._faults_in_a_row.pop(key, None)

    def _step_failed(self, error: Exception) -> None:
        """Fail the requests the fault is found to be (aborted before the next step, which frees their
        blocks): a request that failed alone, or the whole batch when which requests the step touched
        is unknown. A batch of several is run again in smaller groups first (step_bisection.py)."""
        ids = self.engine.last_step_request_ids()
        if ids is None:  # which requests the step touched is unknown: none of them can be trusted
            ids = list(self.engine.requests)
            to_fail = ids
        else:
            to_fail = self._bisection.failed(ids)
        if not to_fail:
            logger.error("an engine step failed (%s: %s); its requests run again in smaller groups",
                         type(error).__name__, error)
            return
        for rid in to_fail:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(RequestFailedError(f"engine step failed: {type(error).__name__}: {error}"))
            self._pending_aborts.append(rid)
        self._fault("step", error, f"an engine step ({plural(len(to_fail), 'request')} in its batch)")

    def _die(self, error: Exception) -> None:
        """The engine cannot go on: fail every request, refuse new ones, tell the server."""
        self.fatal_error = error
        if isinstance(error, TooManyFaults):  # each failure was logged as it came
            logger.critical("the engine loop stopped: %s", error)
        else:
            logger.critical("the engine loop stopped on an error outside any request", exc_info=error)
        for stream in [*self._streams.values(), *self._final_on_abort.values()]:
            stream.put(EngineDeadError(f"the engine failed: {error}"))
        self._streams.clear()
        self._final_on_abort.clear()
        for cb in self.fatal_callbacks:
            try:
                cb(error)
            except Exception:
                logger.exception("a fatal-error callback failed")

    def _inject_step_faults(self) -> None:
        """Test-only: ``step`` faults raise inside the model run, after the schedule took its blocks."""
        runner = self.engine.model_runner
        execute = runner.execute
        seqs = self.engine.scheduler.seqs_by_id

        def execute_with_faults(scheduler_output: Any) -> Any:
            self.faults.check("step", (seqs[it.seq_id].request.prompt for it in scheduler_output.scheduled))
            return execute(scheduler_output)

        runner.execute = execute_with_faults  # type: ignore[method-assign]

    async def _run(self) -> None:
        # One guard around all of it: the loop never ends silently, and never by a request's fault.
        try:
            while True:
                await self._run_once()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._die(e)

    async def _run_once(self) -> None:
        assert self._wakeup is not None
        engine = self.engine
        if not (self._pending_adds or self._pending_aborts or engine.has_unfinished_requests()):
            self._wakeup.clear()
            await self._wakeup.wait()
        self.faults.check("loop")
        self._apply_pending()
        if not engine.has_unfinished_requests():
            for cb in self.step_callbacks:  # idle now (aborts, say): callbacks see the final state
                self._call(cb, [], "callback")
            await asyncio.sleep(0)  # an abort to retry must not spin without letting handlers run
            return
        # A task of its own, so that stop() can wait for a step still running in its thread
        # before it touches the engine.
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-step")
        self._bisection.before_step()
        self._step = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self._step_thread, engine.step))
        try:
            outputs = await asyncio.shield(self._step)
        except asyncio.CancelledError:
            raise
        except WorkerDiedError:
            raise  # no step can run any more: the loop dies, saying why
        except Exception as e:
            self._serve_reads()
            self._step_failed(e)
            return
        self._serve_reads()
        self._bisection.succeeded()
        self._fault_cleared("step")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        for cb in self.step_callbacks:
            self._call(cb, outputs, "callback")
        await asyncio.sleep(0)  # let handlers run between back-to-back steps
