"""``AsyncPoolingEngine``: the pooling engine behind the server. One step thread owns the engine: it takes
the inputs handlers submit, batches those waiting across requests by the token budget, runs a step and
resolves each input's future on the event loop. Tokenizing runs on one tokenizer thread (a fast
tokenizer must not be used by two threads at once)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagellm.engine.pooling_engine import PoolingEngine, PoolingPrompt
from pagellm.outputs import PoolingRequestOutput

logger = logging.getLogger(__name__)

_Submit = tuple[str, list[int], "list[int] | None", str, "asyncio.Future[PoolingRequestOutput]",
                asyncio.AbstractEventLoop]


class EngineUnavailable(RuntimeError):
    """The server is stopping or the engine failed: the request is refused (a 503)."""


class AsyncPoolingEngine:
    def __init__(self, engine: PoolingEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue[_Submit | tuple[str, list[str]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._futures: dict[str, tuple[asyncio.Future[PoolingRequestOutput], asyncio.AbstractEventLoop]] = {}
        self._in_flight = 0  # inputs submitted and not yet answered (read from the event loop)
        self._ids = itertools.count()
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenize")
        self.fatal_error: BaseException | None = None
        self.fatal_callbacks: list[Callable[[BaseException], None]] = []
        # Called on the step thread after each step with its batch's inputs and tokens.
        self.step_callbacks: list[Callable[[int, int], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pagellm-pooling", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._tokenizer.shutdown(wait=False)

    def num_in_flight(self) -> int:
        return self._in_flight

    def abort_all(self) -> int:
        """Refuse new inputs; fail those still waiting (the step thread ends)."""
        n = self._in_flight
        self._stopping = True
        self._wake.set()
        return n

    # ------------------------------------------------------------------ requests
    async def tokenize(self, prompts: Sequence[PoolingPrompt], truncate_prompt_tokens: int | None = None,
                       ) -> list[tuple[list[int], list[int] | None]]:
        """Each input's tokens, on the tokenizer thread; ValueError for a bad or over-long input."""
        def work() -> list[tuple[list[int], list[int] | None]]:
            return [self.engine.tokenize(p, truncate_prompt_tokens) for p in prompts]
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, work)

    async def run(self, inputs: Sequence[tuple[list[int], list[int] | None]], task: str,
                  ) -> list[PoolingRequestOutput]:
        """Pool tokenized inputs (one engine request each), batched with other requests' inputs."""
        if self._stopping or self.fatal_error is not None:
            raise EngineUnavailable("the server is shutting down" if self.fatal_error is None
                                    else f"the engine failed: {self.fatal_error}")
        if task not in self.engine.tasks():
            raise ValueError(f"this model does not {task}: it was loaded for {self.engine.task} (--convert)")
        if self.max_waiting_requests is not None and self._in_flight >= self.max_waiting_requests:
            raise EngineUnavailable(f"the waiting queue is full ({self.max_waiting_requests} inputs): retry later")
        loop = asyncio.get_running_loop()
        ids = [f"pool-{next(self._ids)}" for _ in inputs]
        futures: list[asyncio.Future[PoolingRequestOutput]] = []
        for rid, (tokens, types) in zip(ids, inputs):
            fut: asyncio.Future[PoolingRequestOutput] = loop.create_future()
            futures.append(fut)
            self._inbox.put((rid, tokens, types, task, fut, loop))
        self._in_flight += len(ids)
        self._wake.set()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            self._inbox.put(("abort", ids))  # a client gone or one input failed: drop the rest
            self._wake.set()
            raise
        finally:
            self._in_flight -= len(ids)

    # ------------------------------------------------------------------ the step thread
    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "abort" and len(item) == 2:
                ids = item[1]
                self.engine.abort_request(ids)
                for rid in ids:
                    self._futures.pop(rid, None)
                continue
            rid, tokens, types, task, fut, loop = item  # type: ignore[misc]
            self._futures[rid] = (fut, loop)
            self.engine.enqueue(rid, tokens, types, task)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._take_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                results = self.engine.step()
                for rid, result in results:
                    entry = self._futures.pop(rid, None)
                    if entry is not None:
                        entry[1].call_soon_threadsafe(_resolve, entry[0], result)
                tokens = sum(len(r.prompt_token_ids) for _, r in results if isinstance(r, PoolingRequestOutput))
                for on_step in self.step_callbacks:
                    on_step(len(results), tokens)
        except BaseException as e:  # the engine itself broke: fail everything, stop the server
            logger.exception("the pooling engine failed")
            self.fatal_error = e
            for on_fatal in self.fatal_callbacks:
                on_fatal(e)
        finally:
            self._take_inbox()
            for fut, loop in self._futures.values():
                loop.call_soon_threadsafe(_resolve, fut, EngineUnavailable("the server is shutting down"))
            self._futures.clear()


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
