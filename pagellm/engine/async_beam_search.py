"""Beam search on the server's async engine: ``BeamSearch``'s steps as requests among everyone else's.

Each step's requests are the ones ``beam_search`` runs offline (one greedy token per beam with the
top ``2 * beam_width`` logprobs), so the beams are the same; the event loop only waits for them
between steps, while the engine serves other clients' requests in the same batches.
"""

from __future__ import annotations

import asyncio
import itertools

from pagellm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagellm.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagellm.outputs import RequestOutput


async def _final(stream: RequestStream) -> RequestOutput:
    """The stream's finished output."""
    last = None
    async for out in stream:
        last = out
    if last is None or not last.finished:
        raise RuntimeError(f"beam search step {stream.request_id} ended without an output")
    return last


async def beam_search_async(engine: AsyncLLMEngine, prompts: list[list[int]], params: BeamSearchParams,
                            request_id: str) -> list[BeamSearchOutput]:
    """The ``beam_width`` best sequences of each prompt (token ids), best first, as ``LLM.beam_search``
    gives them. Each step's requests are named ``{request_id}-{k}``; cancelled, the step in flight is
    aborted (its KV blocks freed). Raises what ``AsyncLLMEngine.add_request`` raises (a full queue, bad
    input) and the engine's failure of a step's request."""
    llm = engine.engine
    search = BeamSearch(prompts, params, llm.eos_token_ids, llm.max_model_len)
    counter = itertools.count()
    while jobs := search.next_jobs():
        streams: list[RequestStream] = []
        try:
            for _, beam in jobs:
                streams.append(engine.add_request(f"{request_id}-{next(counter)}", beam.tokens, search.step_params))
            finals = await asyncio.gather(*(_final(s) for s in streams))
        except BaseException:
            for s in streams:  # no-op for finished ones
                s.abort()
            raise
        search.advance(jobs, [f.outputs[0].logprobs[0] for f in finals])  # type: ignore[index]
    return search.outputs(llm.tokenizer)
