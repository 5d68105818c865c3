"""AsyncLLMEngine on a real tiny engine: faults stay with the requests they belong to, the loop never
dies silently, and a shutdown's abort ends every stream with a final output."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pagellm import EngineArgs, LLMEngine, SamplingParams
from pagellm.engine.async_engine import (
    MAX_FAULTS_IN_A_ROW,
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from pagellm.engine.faults import FaultInjector, InjectedFault
from pagellm.outputs import RequestOutput

SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def make_engine(llama_path, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=64, block_size=8,
                                max_num_seqs=max_num_seqs, device="cpu"))


def run(engine: LLMEngine, faults: str, body: Callable[[AsyncLLMEngine], Awaitable[Any]]) -> Any:
    """``body(async_engine)`` with the loop running, then the engine stopped."""
    async def main() -> Any:
        ae = AsyncLLMEngine(engine, faults=FaultInjector.parse(faults))
        ae.start()
        try:
            return await asyncio.wait_for(body(ae), timeout=60)
        finally:
            await ae.stop()
    return asyncio.run(main())


async def drain(stream: RequestStream) -> tuple[RequestOutput | None, BaseException | None]:
    """(last output, the error that ended the stream or None)."""
    last = None
    try:
        async for out in stream:
            last = out
    except Exception as e:
        return last, e
    return last, None


def assert_engine_empty(engine: LLMEngine) -> None:
    manager = engine.kv_cache_manager
    manager.assert_consistent()
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
    assert not engine.requests and not engine.has_unfinished_requests()


def test_a_failed_admission_fails_that_request_alone(llama_path):
    engine = make_engine(llama_path)

    async def body(ae: AsyncLLMEngine) -> None:
        streams = [ae.add_request(f"r{i}", p, SHORT) for i, p in enumerate(["Hello", "POISON here", "Bye"])]
        results = await asyncio.gather(*(drain(s) for s in streams))
        (ok0, err0), (_, err1), (ok2, err2) = results
        assert isinstance(err1, RequestFailedError) and "could not admit" in str(err1)
        assert err0 is None and err2 is None
        assert ok0.finished and ok2.finished and len(ok0.outputs[0].token_ids) == 6
        assert ae.health() is None and ae.is_running
        # The engine still takes requests.
        out, err = await drain(ae.add_request("after", "Hello", SHORT))
        assert err is None and out.finished

    run(engine, "admit:prompt_contains=POISON", body)
    assert_engine_empty(engine)


def generate_alone(engine: LLMEngine, prompt: str) -> list[int]:
    engine.add_request(prompt, prompt, SHORT)
    while True:
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)


def test_a_failed_step_fails_only_the_request_that_fails_alone(llama_path, caplog):
    # Four seats: the victim shares its batch with three others; "late" waits and is not touched.
    engine = make_engine(llama_path, max_num_seqs=4)
    engine_blocks = engine.kv_cache_manager.num_blocks
    alone = make_engine(llama_path, max_num_seqs=4)

    async def body(ae: AsyncLLMEngine) -> None:
        prompts = {"a": "Hello", "victim": "POISON", "b": "Bye", "c": "Again", "late": "Later"}
        streams = [ae.add_request(rid, p, SHORT) for rid, p in prompts.items()]
        results = dict(zip(prompts, await asyncio.gather(*(drain(s) for s in streams))))
        _, err_v = results.pop("victim")
        assert isinstance(err_v, RequestFailedError) and "InjectedFault" in str(err_v)
        for rid, (out, err) in results.items():  # the same tokens as if the step had never failed
            assert err is None and out.finished and out.outputs[0].finish_reason == "length", rid
            assert out.outputs[0].token_ids == generate_alone(alone, prompts[rid]), rid
        assert ae.health() is None
        await asyncio.sleep(0.05)  # the loop applies the victim's abort before its next step
        assert engine.kv_cache_manager.num_free_blocks == engine_blocks

    with caplog.at_level(logging.WARNING):
        run(engine, "step:prompt_contains=POISON,times=inf", body)
    assert_engine_empty(engine)
    assert any("running them again in groups" in r.getMessage() for r in caplog.records)


def test_a_step_failure_then_a_good_step_is_not_fatal(llama_path):
    # One seat: each request is a batch of its own; the first two steps fail, the third works.
    engine = make_engine(llama_path, max_num_seqs=1)

    async def body(ae: AsyncLLMEngine) -> None:
        streams = [ae.add_request(f"r{i}", "Hello", SHORT) for i in range(3)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        errors = [e for _, e in results]
        assert sum(isinstance(e, RequestFailedError) for e in errors) == 2 and errors.count(None) == 1
        assert ae.health() is None and ae.is_running

    run(engine, f"step:times={MAX_FAULTS_IN_A_ROW - 1}", body)
    assert_engine_empty(engine)


def test_a_raising_step_callback_is_skipped_and_called_again(llama_path, caplog):
    engine = make_engine(llama_path)
    calls: list[int] = []

    def flaky(outputs: list[RequestOutput]) -> None:
        calls.append(len(outputs))
        if len(calls) == 1:
            raise ValueError("metrics bug")

    async def body(ae: AsyncLLMEngine) -> None:
        ae.step_callbacks.append(flaky)
        out, err = await drain(ae.add_request("r", "Hello", SHORT))
        assert err is None and out.finished
        assert ae.health() is None

    with caplog.at_level(logging.ERROR, logger="pagellm.engine.async_engine"):
        run(engine, "", body)
    assert len(calls) >= 6  # one per step: it was not dropped after failing
    assert any("flaky failed; the engine goes on" in r.getMessage() and r.exc_info for r in caplog.records)
    assert_engine_empty(engine)


def test_a_failed_abort_is_retried_and_frees_the_blocks(llama_path):
    engine = make_engine(llama_path)

    async def body(ae: AsyncLLMEngine) -> None:
        stream = ae.add_request("r", "POISON", LONG)
        other = ae.add_request("o", "Hello", SHORT)
        await stream.__anext__()  # running, holding blocks
        stream.abort()
        out, err = await drain(other)
        assert err is None and out.finished
        for _ in range(100):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert ae.health() is None

    run(engine, "abort:prompt_contains=POISON", body)
    assert_engine_empty(engine)


def test_an_error_outside_any_request_is_fatal_and_said_once(llama_path, caplog):
    engine = make_engine(llama_path)
    fatal: list[BaseException] = []

    async def body(ae: AsyncLLMEngine) -> None:
        ae.fatal_callbacks.append(fatal.append)
        streams = [ae.add_request(f"r{i}", "Hello", LONG) for i in range(2)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        assert all(isinstance(e, EngineDeadError) for _, e in results)
        await asyncio.sleep(0)
        assert not ae.is_running and isinstance(ae.fatal_error, InjectedFault)
        assert ae.health().startswith("the engine failed: injected fault")
        with pytest.raises(EngineDeadError):
            ae.add_request("late", "Hello", SHORT)

    with caplog.at_level(logging.ERROR, logger="pagellm.engine.async_engine"):
        run(engine, "loop:after=3", body)
    assert len(fatal) == 1
    assert sum(1 for r in caplog.records if r.exc_info) == 1  # the traceback, once
    assert_engine_empty(engine)  # stop() still aborted what the dead loop left


def test_repeated_step_failures_are_fatal(llama_path, caplog):
    engine = make_engine(llama_path, max_num_seqs=1)

    async def body(ae: AsyncLLMEngine) -> None:
        streams = [ae.add_request(f"r{i}", "Hello", SHORT) for i in range(MAX_FAULTS_IN_A_ROW + 1)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        assert all(e is not None for _, e in results)
        assert sum(isinstance(e, EngineDeadError) for _, e in results) >= 1
        assert "failed 3 times in a row" in str(ae.fatal_error) and not ae.is_running

    with caplog.at_level(logging.ERROR, logger="pagellm.engine.async_engine"):
        run(engine, "step:times=inf", body)
    assert sum(1 for r in caplog.records if r.exc_info) == 1  # the first failure's; the repeats in one line
    assert_engine_empty(engine)


def test_abort_all_ends_every_stream_with_an_abort_output(llama_path):
    engine = make_engine(llama_path, max_num_seqs=1)

    async def body(ae: AsyncLLMEngine) -> None:
        running = ae.add_request("running", "Hello", LONG)
        queued = ae.add_request("queued", "Bye", LONG)
        first = await running.__anext__()
        assert not first.finished
        assert ae.abort_all() == 2
        (out_r, err_r), (out_q, err_q) = await asyncio.gather(drain(running), drain(queued))
        assert err_r is None and err_q is None
        assert out_r.finished and out_r.outputs[0].finish_reason == "abort"
        assert len(out_r.outputs[0].token_ids) >= len(first.outputs[0].token_ids) > 0
        assert out_q.finished and out_q.outputs[0].finish_reason == "abort" and not out_q.outputs[0].token_ids
        with pytest.raises(EngineDeadError, match="shutting down"):
            ae.add_request("late", "Hello", SHORT)
        assert ae.health() == "the server is shutting down"

    run(engine, "", body)
    assert_engine_empty(engine)


def test_fault_spec_parsing():
    f = FaultInjector.parse("step:after=2,times=inf; admit:prompt_contains=x")
    assert [(r.point, r.after, r.times, r.prompt_contains) for r in f.rules] == [
        ("step", 2, float("inf"), None), ("admit", 0, 1, "x")]
    for bad in ("nowhere", "step:after", "step:often=1"):
        with pytest.raises(ValueError):
            FaultInjector.parse(bad)
    assert not FaultInjector.parse("")
