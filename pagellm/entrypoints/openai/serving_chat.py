"""``POST /v1/chat/completions``: messages through the chat template -> an engine request -> OpenAI's
chat.completion JSON or chat.completion.chunk SSE events."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from pagellm.engine.input_processor import ChatTemplateSyntaxError
from pagellm.entrypoints.openai import generic_tools as generic
from pagellm.entrypoints.openai.chat_choice import ChatChoiceReader
from pagellm.entrypoints.openai.chat_prompt import (
    ContentFormat,
    TemplateOptions,
    conversation,
    detect_content_format,
    template_options,
)
from pagellm.entrypoints.openai.content_tokens import TokenStarts, content_token_count
from pagellm.entrypoints.openai.errors import APIError, from_value_error
from pagellm.entrypoints.openai.prompt_logprobs import prompt_logprobs_json, requested_prompt_logprobs
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagellm.entrypoints.openai.reasoning_parsers import END as REASONING_END
from pagellm.entrypoints.openai.reasoning_parsers import PromptThinking, ReasoningParser, get_reasoning_parser
from pagellm.entrypoints.openai.serving import ChoiceState, Envelope, Job, OpenAIServing
from pagellm.entrypoints.openai.serving_beam_search import beam_search_chat
from pagellm.entrypoints.openai.structured import request_constraint
from pagellm.entrypoints.openai.tool_calling import ToolMode, tool_mode
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.detect import GENERIC, parser_for_template
from pagellm.outputs import CompletionOutput, Logprob

logger = logging.getLogger("pagellm.server")


@dataclass
class ChatStart:
    """A chat request on its way: its engine job, how its output becomes the API's message, and the
    reply's role."""

    job: Job
    mode: ToolMode
    role: str
    reasoning: ReasoningParser | None = None
    prompt_thinking: PromptThinking = PromptThinking.NONE
    include_reasoning: bool = True

    def reader(self) -> ChatChoiceReader:
        """A reader of one choice's output."""
        return ChatChoiceReader(self.mode, self.reasoning, self.prompt_thinking, self.include_reasoning)


class OpenAIServingChat(OpenAIServing):
    def chat_prompt_ids(self, messages: list[ChatMessage], options: TemplateOptions | None = None,
                        tools: list[dict[str, Any]] | None = None, generic_tools: bool = False) -> list[int]:
        """The prompt's token ids; ``generic_tools``: the tools go into the system prompt in pagellm's
        generic format (the template renders none), not to the template."""
        conv = conversation(messages, self.content_format())
        if generic_tools and tools:
            conv = generic.conversation(conv, tools, as_parts=self.content_format() == "openai")
            tools = None
        options = options or TemplateOptions()
        try:
            return self.llm.apply_chat_template(conv, self.chat_template, options.add_generation_prompt, tools,
                                                continue_final_message=options.continue_final_message,
                                                documents=options.documents, template_kwargs=options.kwargs)
        except ChatTemplateSyntaxError as e:  # the server's template is broken: not the client's doing
            raise APIError(500, str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def content_format(self) -> ContentFormat:
        """``--chat-template-content-format``; ``auto`` is decided once, from the template."""
        if self._content_format is None:
            template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
            self._content_format = detect_content_format(template)
            logger.info("the chat template reads message content as %s (--chat-template-content-format auto; "
                        "give string or openai to choose)",
                        "a list of parts" if self._content_format == "openai" else "a string")
        return self._content_format

    def tool_format(self) -> str:
        """``--tool-call-parser``; ``auto`` is decided once, from the template (tool_parsers/detect.py)."""
        if self.tool_call_parser == "auto":
            template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
            self.tool_call_parser = parser_for_template(template)
            logger.info("tool calls are read as %s (--tool-call-parser auto%s)", self.tool_call_parser,
                        ": the chat template renders no tools, so they go into the system prompt"
                        if self.tool_call_parser == GENERIC else "")
        return self.tool_call_parser

    def _chat_prompt(self, messages: list[ChatMessage], options: TemplateOptions, truncate: int | None = None,
                     tools: list[dict[str, Any]] | None = None, generic_tools: bool = False) -> tuple[str, list[int]]:
        ids = self.chat_prompt_ids(messages, options, tools, generic_tools)
        if truncate is not None:  # vLLM's truncate_prompt_tokens: the last that many tokens
            ids = ids[-truncate:]
        return self.tokenizer.decode(ids), ids

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
        if req.use_beam_search:
            return await self._chat_beam_search(req, http)
        start = await self.start_chat(req)
        job, role = start.job, start.role
        envelope = Envelope(job.streams[0].request_id, "chat.completion", self.reported_model(req.model))
        if req.stream:
            envelope.object = "chat.completion.chunk"
            return self._sse(self._chat_chunks(start, req, envelope))
        finals = await self._collect(job, http)
        if finals is None:
            return JSONResponse({}, status_code=499)
        (out,) = finals
        choices = []
        for c in out.outputs:
            message, called = start.reader().message(c.text, role)
            finish = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._final_logprobs(job, c, req.top_logprobs or 0) if req.logprobs else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            })
        # vLLM's: the prompt's logprobs at the top level, when asked for.
        extra_fields = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                        if req.prompt_logprobs is not None else {})
        return envelope.body(choices, usage=self._usage(job), **extra_fields)

    async def _chat_beam_search(self, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
        """``use_beam_search`` (serving_beam_search.py) on the messages through the chat template."""
        self.check_model(req.model)
        self._check_fields(req)
        options, role = self._template_options(req)

        async def prompt() -> list[tuple[str, list[int]]]:
            return [await self.off_loop(self._chat_prompt, req.messages, options, req.truncate_prompt_tokens)]

        return await beam_search_chat(self, req, http, prompt, role)

    def _template_options(self, req: ChatCompletionRequest) -> tuple[TemplateOptions, str]:
        """The chat template's arguments, and the reply's role: as vLLM, --response-role where the
        template adds a generation prompt, else the role of the last message (which the reply continues)."""
        options = template_options(req.add_generation_prompt, req.continue_final_message, req.documents,
                                   req.chat_template_kwargs, req.messages, req.reasoning_effort)
        return options, self.response_role if options.add_generation_prompt else req.messages[-1].role

    async def start_chat(self, req: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> ChatStart:
        """The request checked, its messages through the chat template, its engine request queued (also
        the Anthropic Messages route's path)."""
        self.check_model(req.model)
        self._check_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_logprobs("top_logprobs", req.top_logprobs)
        prompt_logprobs = requested_prompt_logprobs(self, req)
        options, role = self._template_options(req)
        # max_completion_tokens is OpenAI's newer name for max_tokens; errors name the one given.
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", param=limit_name)
        constraint, constraint_field = request_constraint(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        parser = self.tool_format()
        mode = tool_mode(tools, req.tool_choice, req.parallel_tool_calls, lambda: get_tool_parser(parser, tools))
        generic_tools = parser == GENERIC and mode.kind != "none"
        if generic_tools and mode.kind == "auto" and constraint is None and tools:
            # The answer is text or calls in the generic format (with another constraint, that one holds).
            mode.constraint = generic.constraint(tools, req.parallel_tool_calls is not False)
        if mode.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the output itself: drop "
                                    f"{constraint_field}", param=constraint_field)
            constraint, constraint_field = mode.constraint, "tools"
        text, ids = await self.off_loop(self._chat_prompt, req.messages, options, req.truncate_prompt_tokens,
                                        tools if mode.kind != "none" else None, generic_tools)
        if max_tokens is None:  # the room left, or less where generation_config.json says so
            max_tokens = max(1, min(self.max_model_len - len(ids), self.defaults.get("max_tokens", self.max_model_len)))
        extra: dict[str, Any] = {"skip_special_tokens": False} if mode.keeps_special_tokens else {}
        reasoning, thinking = self.reasoning_of(req, text, extra)
        try:
            params = req.sampling_params(max_tokens=max_tokens, defaults=self.defaults,
                                         logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                         structured_outputs=constraint, prompt_logprobs=prompt_logprobs, **extra)
        except ValueError as e:
            raise from_value_error(e) from e
        await self.compile_constraint(params, constraint_field)
        self._check_length(len(ids), max_tokens, what="messages", max_tokens_name=limit_name)
        return ChatStart(self._start([(text, ids)], params, req, id_prefix), mode, role, reasoning, thinking,
                         req.include_reasoning is not False)

    def reasoning_of(self, req: ChatCompletionRequest, prompt: str,
                     extra: dict[str, Any]) -> tuple[ReasoningParser | None, PromptThinking]:
        """The request's reasoning parser and what its prompt did to the thinking; adds to ``extra`` the
        sampling fields that end the thinking (its marker, the budget)."""
        budget = req.thinking_token_budget if req.thinking_token_budget is not None else req.max_reasoning_tokens
        name = "thinking_token_budget" if req.thinking_token_budget is not None else "max_reasoning_tokens"
        if self.reasoning_parser is None:
            if budget is not None:
                raise APIError(400, f"{name} needs a server started with --reasoning-parser (qwen3, deepseek_r1 or "
                                    "think)", param=name)
            return None, PromptThinking.NONE
        parser = get_reasoning_parser(self.reasoning_parser)
        thinking = PromptThinking.of(prompt)
        if thinking is not PromptThinking.CLOSED:
            extra["reasoning_end_token_ids"] = self.tokenizer.encode(REASONING_END, add_special_tokens=False)
            if budget is not None:
                extra["thinking_token_budget"] = budget
        return parser, thinking

    def _final_logprobs(self, job: Job, c: CompletionOutput, top_n: int) -> dict[str, Any]:
        """A finished choice's ``logprobs``: its content's tokens (content_tokens.py)."""
        starts = (TokenStarts(self.tokenizer, job.prompt_ids[0], job.params.skip_special_tokens)
                  if isinstance(c.stop_reason, str) else None)
        k = content_token_count(c, job.params, len(c.text), starts)
        return {"content": self._chat_logprobs(c.token_ids[:k], (c.logprobs or [])[:k], top_n)}

    @staticmethod
    def _chat_logprobs(token_ids: list[int], entries: list | None, top_n: int) -> list[dict[str, Any]]:
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

    async def _chat_chunks(self, start: ChatStart, req: ChatCompletionRequest,
                           envelope: Envelope) -> AsyncIterator[str]:
        job, role = start.job, start.role
        states: dict[int, ChoiceState] = {}
        # Per choice, where the output may hold thinking or tool calls: what of them was sent.
        readers: dict[int, ChatChoiceReader] = {}
        read = start.mode.kind != "none" or start.reasoning is not None
        # Per choice, with stop strings: where its tokens' text starts (the logprobs sent are those of
        # the text sent).
        starts: dict[int, TokenStarts] = {}
        usage_field: dict[str, Any] = {"usage": None} if req.include_usage else {}
        top_n = req.top_logprobs or 0

        def chunk(choice: dict[str, Any], completion_tokens: int) -> str:
            usage = self._chunk_usage(job, 0, completion_tokens) if req.continuous_usage else usage_field
            return envelope.chunk([choice], **usage)

        for i in range(job.params.n):  # the role comes first, for every choice
            states[i] = ChoiceState(started=True)
            yield chunk({"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                         "finish_reason": None}, 0)
        async for _, out in self._merged(job):
            for c in out.outputs:
                st = states.setdefault(c.index, ChoiceState())
                if st.finished:
                    continue
                visible = self._visible_text(c, job.params, st)
                logprobs = None
                if read:
                    reader = readers.setdefault(c.index, start.reader())
                    finished = c.finish_reason is not None
                    for d in reader.deltas(visible, finished):
                        yield chunk({"index": c.index, "delta": d, "logprobs": None, "finish_reason": None},
                                    len(c.token_ids))
                    if finished:
                        st.finished = True
                        reason = "tool_calls" if reader.called and c.finish_reason == "stop" else c.finish_reason
                        yield chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                                     "stop_reason": c.stop_reason}, len(c.token_ids))
                    continue
                delta = visible[st.text_sent:]
                if req.logprobs:
                    spans = None
                    if job.params.stop_strings:
                        spans = starts.setdefault(c.index, TokenStarts(self.tokenizer, job.prompt_ids[0],
                                                                       job.params.skip_special_tokens))
                    k = content_token_count(c, job.params, len(visible), spans)
                    if k > st.tokens_sent:
                        logprobs = {"content": self._chat_logprobs(
                            c.token_ids[st.tokens_sent:k], (c.logprobs or [])[st.tokens_sent:k], top_n)}
                        st.tokens_sent = k
                if delta or logprobs:
                    st.text_sent += len(delta)
                    yield chunk({"index": c.index, "delta": {"content": delta}, "logprobs": logprobs,
                                 "finish_reason": None}, len(c.token_ids))
                if c.finish_reason is not None:
                    st.finished = True
                    yield chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}, len(c.token_ids))
        if req.include_usage:
            yield envelope.chunk([], usage=self._usage(job))
        yield "data: [DONE]\n\n"

