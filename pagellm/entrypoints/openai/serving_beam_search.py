"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``.

The beam width is ``best_of`` (completions), else ``n``; the ``n`` best beams are the choices. The
search is ``LLM.beam_search``'s, run on the async engine (``engine/async_beam_search.py``), so the
event loop serves everyone else meanwhile and the beams equal the offline ones. As in vLLM, beams are
ranked by the model's raw log-probabilities: temperature, top_p, top_k, min_p, the penalties and seed
do not apply. Fields that would change the output but that beam search does not implement (stop
strings, logit_bias, constraints, logprobs, ...) are a 400 naming them; so is a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from pagellm.engine.async_beam_search import beam_search_async
from pagellm.engine.async_engine import EngineDeadError, QueueFullError
from pagellm.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.entrypoints.openai.errors import APIError, from_value_error
from pagellm.entrypoints.openai.serving import DISCONNECT_POLL_S, Envelope, OpenAIServing

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# The handler's tokenization of the request's prompts: (text, token ids) of each.
Prompts = Callable[[], Awaitable[list[tuple[str, list[int]]]]]

# Fields beam search does not implement, with the values (besides null) that change nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (), "stop": ([], ""), "stop_token_ids": ([],), "logit_bias": ({},),
    "min_tokens": (0,), "structured_outputs": (), "response_format": ({"type": "text"},), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}
COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "logprobs": (), "suffix": ()}
CHAT_UNSUPPORTED = {**UNSUPPORTED, "logprobs": (False,), "top_logprobs": (), "tools": ([],),
                    "tool_choice": ("none",)}


def check_fields(req: SamplingFields, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """400 naming the first field given that beam search does not implement."""
    if req.stream:
        raise APIError(400, "use_beam_search cannot be streamed: the best beams are known only at the end; drop "
                            "stream or use_beam_search", param="stream")
    for name, noops in unsupported.items():
        value = getattr(req, name)
        if value is not None and not any(type(value) is type(v) and value == v for v in noops):
            raise APIError(400, f"'{name}' cannot be used with use_beam_search: beam search does not implement it; "
                                f"remove one of them", param=name)


def beam_params(serving: OpenAIServing, req: SamplingFields, width: int, width_field: str,
                max_tokens: int) -> BeamSearchParams:
    """The search's parameters; a 400 naming the field when the width or max_tokens cannot be served."""
    model = getattr(req, "model", None)
    if serving.reported_model(model) != serving.model_name:
        raise APIError(400, f"use_beam_search with the LoRA adapter '{model}' is not supported yet: sample with the "
                            "adapter, or search on the base model", param="use_beam_search")
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise APIError(400, f"{width_field} is the beam width with use_beam_search: it must be in "
                            f"[1, {MAX_BEAM_WIDTH}], got {width}", param=width_field)
    limit = serving.llm.args.max_logprobs
    if 0 <= limit < 2 * width:  # each step asks for the top 2 * width tokens of every beam
        raise APIError(400, f"a beam width of {width} ranks {2 * width} tokens per beam each step, more than this "
                            f"server's --max-logprobs {limit}: lower {width_field}, or start the server with "
                            f"--max-logprobs {2 * width}", param=width_field)
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty)
    except ValueError as e:
        raise from_value_error(e) from e


async def run_beam_search(serving: OpenAIServing, prompts: list[list[int]], params: BeamSearchParams,
                          request_id: str, http: HTTPRequest) -> list[BeamSearchOutput] | None:
    """The search's outputs; None (the search aborted) when the client disconnects first."""
    task = asyncio.create_task(beam_search_async(serving.engine, prompts, params, request_id))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await http.is_disconnected():
                task.cancel()  # aborts the step in flight
                with contextlib.suppress(BaseException):
                    await task
                return None
    except asyncio.CancelledError:
        task.cancel()
        raise
    try:
        return task.result()
    except QueueFullError as e:
        raise APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not running ({e}): retry on another server") from e
    except ValueError as e:
        raise from_value_error(e) from e
    except APIError:
        raise
    except Exception as e:
        raise APIError(500, f"generation failed: {e}") from e


def _finish_reason(seq: BeamSearchSequence) -> str:
    return "stop" if seq.finished else "length"  # finished: it ended with EOS


def _usage(prompts: list[list[int]], chosen: list[list[BeamSearchSequence]]) -> dict[str, int]:
    prompt = sum(len(ids) for ids in prompts)
    completion = sum(len(s.output_token_ids) for seqs in chosen for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def beam_search_completion(serving: OpenAIServing, req: CompletionRequest, http: HTTPRequest,
                                 tokenize: Prompts) -> Any:
    """``/v1/completions`` with ``use_beam_search``: text_completion JSON, ``n`` choices per prompt;
    ``tokenize``: the completion handler's tokenization of the prompts (called once the fields pass)."""
    check_fields(req, COMPLETION_UNSUPPORTED)
    width, width_field = (req.best_of, "best_of") if req.best_of is not None else (req.n, "n")
    if req.n > width:
        raise APIError(400, f"best_of ({width}) must be >= n ({req.n})", param="best_of")
    max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else serving.defaults.get("max_tokens", 16)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1 with use_beam_search, got {max_tokens}", param="max_tokens")
    prompts = await tokenize()
    if max_tokens is None:  # up to the model's length
        max_tokens = max(1, serving.max_model_len - max(len(ids) for _, ids in prompts))
    for _, ids in prompts:
        serving._check_length(len(ids), max_tokens)
    params = beam_params(serving, req, width, width_field, max_tokens)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    token_ids = [ids for _, ids in prompts]
    outputs = await run_beam_search(serving, token_ids, params, request_id, http)
    if outputs is None:
        return JSONResponse({}, status_code=499)
    chosen = [out.sequences[: req.n] for out in outputs]
    choices = []
    for p, ((text, _), seqs) in enumerate(zip(prompts, chosen)):
        for i, seq in enumerate(seqs):
            choices.append({"index": p * req.n + i, "text": (text if req.echo else "") + (seq.text or ""),
                            "logprobs": None, "finish_reason": _finish_reason(seq), "stop_reason": None})
    envelope = Envelope(request_id, "text_completion", serving.model_name)
    return envelope.body(choices, usage=_usage(token_ids, chosen))


async def beam_search_chat(serving: OpenAIServing, req: ChatCompletionRequest, http: HTTPRequest,
                           tokenize: Prompts, role: str) -> Any:
    """``/v1/chat/completions`` with ``use_beam_search``: chat.completion JSON, the ``n`` best beams;
    ``tokenize``: the chat handler's rendering of the messages (one prompt), ``role``: the replies' role."""
    check_fields(req, CHAT_UNSUPPORTED)
    if serving.reasoning_parser is not None:  # the beams' text would mix the thinking into content
        raise APIError(400, f"use_beam_search is not supported on a server started with --reasoning-parser "
                            f"{serving.reasoning_parser}", param="use_beam_search")
    limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", param=limit_name)
    ((_, ids),) = await tokenize()
    if max_tokens is None:  # the room left, or less where generation_config.json says so
        max_tokens = max(1, min(serving.max_model_len - len(ids),
                                serving.defaults.get("max_tokens", serving.max_model_len)))
    serving._check_length(len(ids), max_tokens, what="messages", max_tokens_name=limit_name)
    params = beam_params(serving, req, req.n, "n", max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = await run_beam_search(serving, [ids], params, request_id, http)
    if outputs is None:
        return JSONResponse({}, status_code=499)
    seqs = outputs[0].sequences[: req.n]
    choices = [{"index": i, "message": {"role": role, "content": seq.text or ""}, "logprobs": None,
                "finish_reason": _finish_reason(seq), "stop_reason": None} for i, seq in enumerate(seqs)]
    envelope = Envelope(request_id, "chat.completion", serving.model_name)
    return envelope.body(choices, usage=_usage([ids], [seqs]))
