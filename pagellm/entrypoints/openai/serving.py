"""What the completion and chat handlers share: the engine requests behind one HTTP request, their
merged output streams, usage, the SSE envelope, and the checks common to both."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from pagellm.engine.detokenizer import StopStringMatcher
from pagellm.entrypoints.openai.errors import APIError, error_body, from_value_error
from pagellm.entrypoints.openai.serving_lora import lora_of
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.text import plural

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.1

logger = logging.getLogger("pagellm.server")
T = TypeVar("T")


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class ChoiceState:
    """What a stream has sent of one choice so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    logprob_offset: int = 0  # text_offset where the next logprob token starts
    started: bool = False
    finished: bool = False
    # The stop-string search over the text seen so far, fed only what each output adds to it.
    stops: StopStringMatcher | None = None


@dataclass
class Envelope:
    """The fields every object of one response carries: OpenAI's id, object, created and model."""

    id: str
    object: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def chunk(self, choices: list[Any], **extra: Any) -> str:
        """One SSE event of a stream."""
        return sse(self.body(choices, **extra))


@dataclass
class Job:
    """The engine requests behind one HTTP request (one per prompt)."""

    streams: list[RequestStream]
    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


@dataclass
class RequestLogging:
    """``--enable-log-requests``: a line per engine request as it is queued; ``max_log_len`` caps the
    prompt characters and token ids shown (None: all)."""

    max_log_len: int | None = None

    def log(self, request_id: str, text: str, ids: list[int], params: SamplingParams) -> None:
        n = self.max_log_len
        shown_ids = ids if n is None or len(ids) <= n else [*ids[:n], "..."]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, %s", request_id,
                    text if n is None else text[:n], params, shown_ids, plural(len(ids), "prompt token"))


@dataclass(frozen=True)
class ChatOptions:
    """How chat requests are read and answered: the serve (and run-batch) flags of the same names."""

    chat_template: str | None = None  # None: the tokenizer's own
    # How tool calls are read (auto: the format the chat template speaks, decided on first use).
    tool_call_parser: str = "auto"
    # Accepted as vLLM's and changes nothing: "auto" tool choice always works.
    enable_auto_tool_choice: bool = False
    response_role: str = "assistant"
    chat_template_content_format: str = "auto"  # string, openai, or auto (from the template)
    reasoning_parser: str | None = None  # which part of a reasoning model's output is its thinking

    @classmethod
    def from_args(cls, args: Any, chat_template: str | None) -> ChatOptions:
        """The options of parsed serve or run-batch flags (``chat_template`` loaded from its flag)."""
        return cls(chat_template, args.tool_call_parser or "auto", getattr(args, "enable_auto_tool_choice", False),
                   args.response_role, args.chat_template_content_format, args.reasoning_parser)


class OpenAIServing:
    """The state and helpers both handlers use (``OpenAIServingCompletion``, ``OpenAIServingChat``)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, aliases: tuple[str, ...] = (),
                 request_logging: RequestLogging | None = None, chat: ChatOptions | None = None) -> None:
        chat = chat or ChatOptions()
        self.engine = engine
        self.response_role = chat.response_role
        self.request_logging = request_logging
        self.tool_call_parser = chat.tool_call_parser
        self.enable_auto_tool_choice = chat.enable_auto_tool_choice
        self.reasoning_parser = chat.reasoning_parser
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.model_name = model_name  # the name responses report
        self.model_names = (model_name, *aliases)  # every name a request may use (--served-model-name)
        # Sampling defaults of requests that leave them unset (the model's generation_config.json).
        self.defaults = self.llm.default_sampling_fields
        self.max_model_len = self.llm.max_model_len
        self.chat_template = chat.chat_template
        # Message content as a string or as OpenAI's list of parts (None: auto, decided from the
        # template on first use).
        self._content_format: Literal["string", "openai"] | None = (
            None if chat.chat_template_content_format == "auto" else chat.chat_template_content_format)  # type: ignore[assignment]
        # Tokenizing (and chat templates) off the event loop, so that a long prompt does not stall
        # every other client's stream; one thread, so requests' tokenizations never overlap.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # --------------------------------------------------------------- common
    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is a name of the base model or of a LoRA adapter served."""
        if model is not None and model not in self.model_names and lora_of(self.llm, model) is None:
            adapters = list(self.llm.lora.registered) if self.llm.lora is not None else []
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in [*self.model_names, *adapters])}",
                           param="model", code="model_not_found")

    def reported_model(self, model: str | None) -> str:
        """The name a response reports: the LoRA adapter's where the request named one."""
        return model if model is not None and lora_of(self.llm, model) is not None else self.model_name

    def check_logprobs(self, name: str, n: int | None) -> None:
        """400 naming the field unless ``n`` (logprobs asked for) is within ``--max-logprobs``."""
        limit = self.llm.args.max_logprobs
        if n is None:
            return
        if n < 0:
            raise APIError(400, f"{name} must be an integer >= 0, got {n}", param=name)
        if 0 <= limit < n:
            raise APIError(400, f"{name} is {n}, more than this server allows (--max-logprobs {limit}): ask for at "
                                f"most {limit}, or start the server with a larger --max-logprobs", param=name)

    def _check_length(self, prompt_len: int, max_tokens: int, what: str = "prompt",
                      max_tokens_name: str = "max_tokens") -> None:
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            has = "have" if what == "messages" else "has"
            raise APIError(
                400,
                f"this model's maximum context length is {plural(self.max_model_len, 'token')}, but the {what} "
                f"{has} {plural(prompt_len, 'token')} and {max_tokens_name} is {max_tokens} ({total} in all): "
                f"shorten the {what} or lower {max_tokens_name}",
                param=max_tokens_name if prompt_len < self.max_model_len else what,
                code="context_length_exceeded",
            )

    def _start(self, prompts: list[tuple[str, list[int]]], params: SamplingParams, req: Any, prefix: str) -> Job:
        base = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids, "cache_salt": req.cache_salt}
                if self.request_logging is not None:
                    self.request_logging.log(rid, text, ids, params)
                streams.append(self.engine.add_request(rid, prompt, params, priority=req.priority,
                                                       ttft_slo=req.ttft_slo, tpot_slo=req.tpot_slo,
                                                       lora_request=lora_of(self.llm, getattr(req, "model", None))))
        except (QueueFullError, EngineDeadError, ValueError) as e:
            for s in streams:  # one prompt refused: none of the request's prompts runs
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
            if isinstance(e, EngineDeadError):  # shutting down
                raise APIError(503, f"the engine is not running ({e}): retry on another server") from e
            raise from_value_error(e) from e
        return Job(streams, [ids for _, ids in prompts], [t for t, _ in prompts], params)

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all the job's streams as they come, tagged with the prompt index."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # engine failure: surface it to the consumer
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(job.streams)]
        open_streams = len(tasks)
        try:
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {item}")
                else:
                    if item.finished:
                        job.finals[i] = item
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            job.abort()  # no-op for finished streams; frees the rest when the client went away

    async def _collect(self, job: Job, http: HTTPRequest) -> list[RequestOutput] | None:
        """Wait for every final output; None (and everything aborted) if the client disconnects first."""
        async def drain() -> None:
            async for _ in self._merged(job):
                pass

        task = asyncio.create_task(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    break
                if await http.is_disconnected():
                    task.cancel()
                    job.abort()
                    return None
        except asyncio.CancelledError:
            task.cancel()
            job.abort()
            raise
        return [job.finals[i] for i in range(len(job.streams))]

    def _usage(self, job: Job) -> dict[str, int]:
        prompt = sum(len(ids) for ids in job.prompt_ids)
        completion = sum(len(c.token_ids) for out in job.finals.values() for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _chunk_usage(job: Job, prompt_index: int, completion_tokens: int) -> dict[str, Any]:
        """A chunk's ``usage`` under continuous usage stats: its choice's prompt and tokens so far, as in vLLM."""
        prompt = len(job.prompt_ids[prompt_index])
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                          "total_tokens": prompt + completion_tokens}}

    async def compile_constraint(self, params: SamplingParams, field: str | None) -> None:
        """Compile the request's output constraint on the compile thread (the engine then finds it
        compiled), while the event loop serves everyone else; a 400 naming ``field`` when the schema,
        regex or grammar is invalid, beyond a limit, or unsatisfiable."""
        if params.structured_outputs is None:
            return
        try:
            manager = self.llm.structured_output
            manager.accepted(await asyncio.wrap_future(manager.submit(params.structured_outputs)))
        except ValueError as e:
            raise APIError(400, f"{field}: {e}" if field else str(e), param=field) from e

    def _check_fields(self, req: Any) -> None:
        """400 for fields that would change the output and are not implemented here."""
        unsupported = req.unsupported_field()
        if unsupported:
            raise APIError(400, f"'{unsupported}' is not supported by this server; remove it", param=unsupported)
        if not req.spaces_between_special_tokens and not getattr(self.tokenizer, "is_fast", False):
            # A fast tokenizer's decoding has no such option (nor does vLLM's use of it); a slow one's has.
            raise APIError(400, "spaces_between_special_tokens=false is not supported by this server; remove it",
                           param="spaces_between_special_tokens")

    @staticmethod
    def _visible_text(c: CompletionOutput, params: SamplingParams, st: ChoiceState) -> str:
        """Text a stream may send now: a tail that could still become a stop string is held back."""
        if c.finish_reason is not None or not params.stop_strings:
            return c.text
        if st.stops is None or st.stops.length > len(c.text):  # (the engine's text only grows)
            # Only the last max_stop_string_len - 1 characters can be held back: start there.
            start = max(0, len(c.text) - params.max_stop_string_len + 1)
            st.stops = StopStringMatcher(params.stop_strings, params.stop_tables, start=start)
        st.stops.feed(c.text[st.stops.length:])
        return c.text[: len(c.text) - st.stops.hold]

    @staticmethod
    def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(ending_with_an_error_event(chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def ending_with_an_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chunks; a failure after the 200 went out (the engine failed, the server shuts down) ends
    the stream with an error event and ``[DONE]``, as vLLM does, rather than a cut connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:
        if isinstance(e, APIError):
            err = e
        else:
            logger.exception("a stream failed")
            err = APIError(500, f"internal error: {type(e).__name__}: {e}")
        yield sse(error_body(err.status, err.message, err.param, err.code))
        yield "data: [DONE]\n\n"
