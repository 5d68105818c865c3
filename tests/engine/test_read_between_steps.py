"""AsyncLLMEngine.read_between_steps: a read asked for during a step runs after it, before the next one,
never while the step's thread changes the engine."""

from __future__ import annotations

import asyncio
import threading

from pagellm import EngineArgs, LLMEngine, SamplingParams
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.kv_state import kv_state

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_reads_run_between_steps_and_see_a_consistent_cache(llama_path):
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=64, block_size=8,
                                  device="cpu"))
    stepping = threading.Event()
    step = engine.step

    def watched_step():  # marks the window in which the engine changes, in its worker thread
        stepping.set()
        try:
            return step()
        finally:
            stepping.clear()

    engine.step = watched_step  # type: ignore[method-assign]

    def read(e: LLMEngine) -> dict:
        assert not stepping.is_set(), "read while a step ran"
        e.kv_cache_manager.assert_consistent()
        return kv_state(e.kv_cache_manager, e.scheduler)

    async def main() -> list[dict]:
        ae = AsyncLLMEngine(engine)
        ae.start()
        try:
            prefix = list(range(10, 42))  # four blocks of 8
            first = ae.add_request("r0", prefix + [5], LONG)
            await first.__anext__()  # its prompt is done: its full blocks are cached for the others
            streams = [first] + [ae.add_request(f"r{i}", prefix + [5 + i], LONG) for i in (1, 2)]
            states = []

            async def drain(stream):
                async for _ in stream:
                    pass

            consumers = asyncio.gather(*(drain(s) for s in streams))
            while not consumers.done():
                states.append(await ae.read_between_steps(read))
                await asyncio.sleep(0)
            await consumers
            states.append(await ae.read_between_steps(read))
            return states
        finally:
            await ae.stop()

    states = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(states) > 3
    assert any(s["requests"] for s in states) and states[-1]["requests"] == []
    assert any(s["pool"]["counts"]["shared"] for s in states), "the three prompts share their prefix blocks"
    assert set(states[-1]["pool"]["states"]) <= {"f", "c"}
