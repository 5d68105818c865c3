"""Completion and chat handlers: request -> engine streams -> OpenAI JSON or SSE chunks."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from pagellm.engine.llm_engine import ChatTemplateSyntaxError
from pagellm.engine.detokenizer import StopStringMatcher
from pagellm.entrypoints.openai.errors import APIError, error_body, from_value_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

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
    stops: Optional[StopStringMatcher] = None


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


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, chat_template: Optional[str] = None,
                 aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.model_name = model_name  # the name responses report
        self.model_names = (model_name, *aliases)  # every name a request may use (--served-model-name)
        # Sampling defaults of requests that leave them unset (the model's generation_config.json).
        self.defaults = self.llm.default_sampling_fields
        self.max_model_len = self.llm.max_model_len
        self.chat_template = chat_template  # None: the tokenizer's own
        # Tokenizing (and chat templates) off the event loop, so that a long prompt does not stall
        # every other client's stream; one thread, so requests' tokenizations never overlap.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # --------------------------------------------------------------- common
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}",
                           param="model", code="model_not_found")

    def _check_length(self, prompt_len: int, max_tokens: int, what: str = "prompt",
                      max_tokens_name: str = "max_tokens") -> None:
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the {what} has "
                f"{prompt_len} tokens and {max_tokens_name} is {max_tokens} ({total} in all): shorten the {what} "
                f"or lower {max_tokens_name}",
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
                streams.append(self.engine.add_request(rid, prompt, params, priority=req.priority,
                                                       ttft_slo=req.ttft_slo, tpot_slo=req.tpot_slo))
        except QueueFullError as e:
            for s in streams:
                s.abort()
            raise APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
        except EngineDeadError as e:  # shutting down
            for s in streams:
                s.abort()
            raise APIError(503, f"the engine is not running ({e}): retry on another server") from e
        except ValueError as e:
            for s in streams:
                s.abort()
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

    async def _collect(self, job: Job, http: HTTPRequest) -> Optional[list[RequestOutput]]:
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

    # ------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, http: HTTPRequest) -> Any:
        self.check_model(req.model)
        self._check_fields(req)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server; remove it", param="suffix")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {req.max_tokens}", param="max_tokens")
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is allowed only with echo, to score a prompt)",
                           param="max_tokens")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(400, f"best_of ({req.best_of}) > n ({req.n}) cannot be streamed: which samples are the "
                                "best is known only at the end; drop stream or best_of", param="best_of")
        prompts = await self._completion_prompts(req.prompt, req.add_special_tokens, req.truncate_prompt_tokens)
        # Left out, max_tokens is the model's generation_config.json max_new_tokens, else OpenAI's 16.
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else self.defaults.get("max_tokens", 16)
        try:
            params = req.sampling_params(
                max_tokens=1 if echo_only else max_tokens,
                defaults=self.defaults,
                best_of=req.best_of,
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            )
        except ValueError as e:
            raise from_value_error(e) from e
        for _, ids in prompts:
            if echo_only and len(ids) >= self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but the "
                                    f"prompt has {len(ids)}: to score a prompt with echo it must be shorter",
                               param="prompt", code="context_length_exceeded")
            self._check_length(len(ids), params.max_tokens or 1)
        job = self._start(prompts, params, req, "cmpl")
        created = int(time.time())
        rid = job.streams[0].request_id
        if req.stream:
            return self._sse(self._completion_chunks(job, req, rid, created, echo_only))
        finals = await self._collect(job, http)
        if finals is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                choices.append(self._completion_choice(p * req.n + c.index, out, c, req, echo_only))
        usage = self._usage(job)
        if echo_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

    async def _completion_prompts(self, prompt: Any, add_special_tokens: bool = True,
                                  truncate: Optional[int] = None) -> list[tuple[str, list[int]]]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        limit = self.engine.max_waiting_requests
        if limit is not None and len(items) > limit:
            raise APIError(400, f"{len(items)} prompts in one request, but the server queues at most {limit} "
                                "requests: send them in smaller batches", param="prompt")
        return await self.off_loop(self._tokenize_all, items, add_special_tokens, truncate)

    def _tokenize_all(self, items: list[Any], add_special_tokens: bool = True,
                      truncate: Optional[int] = None) -> list[tuple[str, list[int]]]:
        """(text, ids) of each prompt; ``truncate``: keep only the last that many tokens (vLLM's
        ``truncate_prompt_tokens``), the text then being theirs."""
        out = []
        for item in items:
            if isinstance(item, str) and item and not add_special_tokens:
                item = {"prompt": item, "prompt_token_ids": self.tokenizer.encode(item, add_special_tokens=False)}
            try:
                text, ids = self.llm.tokenize_prompt(item)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from e
            if truncate is not None and len(ids) > truncate:
                ids, text = ids[-truncate:], None
            out.append((text if text is not None else self.tokenizer.decode(ids), ids))
        return out

    def _completion_logprobs(self, out: RequestOutput, c: CompletionOutput, echo: bool, echo_only: bool,
                             text_start: int = 0, token_start: int = 0) -> dict[str, list]:
        tokens: list[str] = []
        token_lps: list[Optional[float]] = []
        tops: list[Optional[dict[str, float]]] = []
        entries: list[tuple[int, Optional[dict[int, Logprob]]]] = []
        if echo:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            entries.extend(zip(out.prompt_token_ids, plp))
        if not echo_only:
            entries.extend(zip(c.token_ids, c.logprobs or []))
        offset = text_start
        offsets = []
        for tid, entry in entries[token_start:]:
            token = entry[tid].decoded_token if entry and tid in entry else self.tokenizer.decode([tid])
            tokens.append(token or "")
            token_lps.append(entry[tid].logprob if entry and tid in entry else None)
            tops.append(None if not entry else {(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
            offsets.append(offset)
            offset += len(token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _completion_choice(self, index: int, out: RequestOutput, c: CompletionOutput, req: CompletionRequest,
                           echo_only: bool) -> dict[str, Any]:
        prompt_text = out.prompt or ""
        text = prompt_text if echo_only else ((prompt_text if req.echo else "") + c.text)
        logprobs = (self._completion_logprobs(out, c, req.echo, echo_only)
                    if req.logprobs is not None else None)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": "length" if echo_only else c.finish_reason, "stop_reason": c.stop_reason}

    async def _completion_chunks(self, job: Job, req: CompletionRequest, rid: str, created: int,
                                 echo_only: bool) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        usage_field: dict[str, Any] = {"usage": None} if req.include_usage else {}
        async for p, out in self._merged(job):
            for c in out.outputs:
                index = p * req.n + c.index
                st = states.setdefault(index, ChoiceState())
                if st.finished:
                    continue
                if req.continuous_usage:
                    usage_field = self._chunk_usage(job, p, 0 if echo_only else len(c.token_ids))
                if echo_only:
                    choice = self._completion_choice(index, out, c, req, True)
                    if not out.finished:
                        continue
                    st.finished = True
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": self.model_name, "choices": [choice], **usage_field})
                    continue
                visible = self._visible_text(c, job.params, st)
                delta = visible[st.text_sent:]
                echo_text = (out.prompt or "") if req.echo and not st.started else ""
                logprobs = None
                if req.logprobs is not None and (len(c.token_ids) > st.tokens_sent or echo_text):
                    # Only the tokens not sent yet (the prompt's too, in the first chunk of an echo).
                    first_echo = bool(echo_text)
                    logprobs = self._completion_logprobs(out, c, first_echo, False, text_start=st.logprob_offset,
                                                         token_start=0 if first_echo else st.tokens_sent)
                    if logprobs["tokens"]:
                        st.logprob_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    st.tokens_sent = len(c.token_ids)
                finish = c.finish_reason
                if not (delta or echo_text or finish or logprobs):
                    continue
                st.text_sent += len(delta)
                st.started = True
                st.finished = finish is not None
                choice = {"index": index, "text": echo_text + delta, "logprobs": logprobs,
                          "finish_reason": finish, "stop_reason": c.stop_reason if finish else None}
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [choice], **usage_field})
        if req.include_usage:
            usage = self._usage(job)
            if echo_only:
                usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------- chat
    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        conversation = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise APIError(400, f"messages[{i}].content: content part type {part.get('type')!r} is not "
                                            "supported; only text parts are", param=f"messages.{i}.content")
                    if not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: a text part needs a 'text' string, as in "
                                            "{'type': 'text', 'text': 'Hello'}", param=f"messages.{i}.content")
                    texts.append(part["text"])
                content = "".join(texts)
            role = "system" if m.role == "developer" else m.role
            conversation.append({"role": role, "content": content or ""})
        try:
            return self.llm.apply_chat_template(conversation, self.chat_template, add_generation_prompt)
        except ChatTemplateSyntaxError as e:  # the server's template is broken: not the client's doing
            raise APIError(500, str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     truncate: Optional[int] = None) -> tuple[str, list[int]]:
        ids = self.chat_prompt_ids(messages, add_generation_prompt)
        if truncate is not None:  # vLLM's truncate_prompt_tokens: the last that many tokens
            ids = ids[-truncate:]
        return self.tokenizer.decode(ids), ids

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
        self.check_model(req.model)
        self._check_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {req.top_logprobs}",
                           param="top_logprobs")
        # max_completion_tokens is OpenAI's newer name for max_tokens; errors name the one given.
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", param=limit_name)
        text, ids = await self.off_loop(self._chat_prompt, req.messages, req.add_generation_prompt,
                                        req.truncate_prompt_tokens)
        if max_tokens is None:  # the room left, or less where generation_config.json says so
            max_tokens = max(1, min(self.max_model_len - len(ids), self.defaults.get("max_tokens", self.max_model_len)))
        try:
            params = req.sampling_params(max_tokens=max_tokens, defaults=self.defaults,
                                         logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        except ValueError as e:
            raise from_value_error(e) from e
        self._check_length(len(ids), max_tokens, what="messages", max_tokens_name=limit_name)
        job = self._start([(text, ids)], params, req, "chatcmpl")
        created = int(time.time())
        rid = job.streams[0].request_id
        if req.stream:
            return self._sse(self._chat_chunks(job, req, rid, created))
        finals = await self._collect(job, http)
        if finals is None:
            return JSONResponse({}, status_code=499)
        (out,) = finals
        choices = [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": ({"content": self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)}
                         if req.logprobs else None),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(job)}

    @staticmethod
    def _chat_logprobs(token_ids: list[int], entries: Optional[list], top_n: int) -> list[dict[str, Any]]:
        """OpenAI's chat ``logprobs.content``: each token with its ``top_n`` alternatives."""
        def item(lp: Logprob) -> dict[str, Any]:
            tok = lp.decoded_token or ""
            return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8"))}

        content = []
        for tid, entry in zip(token_ids, entries or []):
            chosen = item(entry[tid])
            tops = sorted((v for v in entry.values() if v.rank is not None and v.rank <= top_n), key=lambda v: v.rank)
            chosen["top_logprobs"] = [item(v) for v in tops]
            content.append(chosen)
        return content

    async def _chat_chunks(self, job: Job, req: ChatCompletionRequest, rid: str, created: int) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        usage_field: dict[str, Any] = {"usage": None} if req.include_usage else {}
        top_n = req.top_logprobs or 0

        def chunk(choice: dict[str, Any], completion_tokens: int) -> str:
            usage = self._chunk_usage(job, 0, completion_tokens) if req.continuous_usage else usage_field
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [choice], **usage})

        for i in range(job.params.n):  # the role comes first, for every choice
            states[i] = ChoiceState(started=True)
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, 0)
        async for _, out in self._merged(job):
            for c in out.outputs:
                st = states.setdefault(c.index, ChoiceState())
                if st.finished:
                    continue
                delta = self._visible_text(c, job.params, st)[st.text_sent:]
                logprobs = None
                if req.logprobs and len(c.token_ids) > st.tokens_sent:
                    logprobs = {"content": self._chat_logprobs(
                        c.token_ids[st.tokens_sent:], (c.logprobs or [])[st.tokens_sent:], top_n)}
                    st.tokens_sent = len(c.token_ids)
                if delta or logprobs:
                    st.text_sent += len(delta)
                    yield chunk({"index": c.index, "delta": {"content": delta}, "logprobs": logprobs,
                                 "finish_reason": None}, len(c.token_ids))
                if c.finish_reason is not None:
                    st.finished = True
                    yield chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}, len(c.token_ids))
        if req.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "choices": [], "usage": self._usage(job)})
        yield "data: [DONE]\n\n"

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
