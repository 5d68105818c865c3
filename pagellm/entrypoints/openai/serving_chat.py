"""``POST /v1/chat/completions``: messages through the chat template -> an engine request -> OpenAI's
chat.completion JSON or chat.completion.chunk SSE events."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from pagellm.engine.input_processor import ChatTemplateSyntaxError
from pagellm.entrypoints.openai.errors import APIError, from_value_error
from pagellm.entrypoints.openai.prompt_logprobs import prompt_logprobs_json, requested_prompt_logprobs
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagellm.entrypoints.openai.serving import ChoiceState, Envelope, Job, OpenAIServing
from pagellm.entrypoints.openai.serving_beam_search import beam_search_chat
from pagellm.entrypoints.openai.structured import request_constraint
from pagellm.entrypoints.openai.tool_calling import ToolCallStream, ToolMode, message_tool_calls, tool_mode
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.outputs import Logprob


class OpenAIServingChat(OpenAIServing):
    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
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
            entry: dict[str, Any] = {"role": role, "content": content or ""}
            if m.tool_calls:
                entry["tool_calls"] = history_tool_calls(m.tool_calls, i)
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None and role == "tool":
                entry["name"] = m.name
            conversation.append(entry)
        try:
            return self.llm.apply_chat_template(conversation, self.chat_template, add_generation_prompt, tools)
        except ChatTemplateSyntaxError as e:  # the server's template is broken: not the client's doing
            raise APIError(500, str(e)) from e
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     truncate: int | None = None, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        ids = self.chat_prompt_ids(messages, add_generation_prompt, tools)
        if truncate is not None:  # vLLM's truncate_prompt_tokens: the last that many tokens
            ids = ids[-truncate:]
        return self.tokenizer.decode(ids), ids

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Any:
        self.check_model(req.model)
        self._check_fields(req)
        if req.use_beam_search:
            async def prompt() -> list[tuple[str, list[int]]]:
                return [await self.off_loop(self._chat_prompt, req.messages, req.add_generation_prompt,
                                            req.truncate_prompt_tokens, None)]

            return await beam_search_chat(self, req, http, prompt, self.chat_response_role(req))
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_logprobs("top_logprobs", req.top_logprobs)
        prompt_logprobs = requested_prompt_logprobs(self, req)
        # max_completion_tokens is OpenAI's newer name for max_tokens; errors name the one given.
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{limit_name} must be an integer >= 1, got {max_tokens}", param=limit_name)
        constraint, constraint_field = request_constraint(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        parser = self.tool_call_parser
        mode = tool_mode(tools, req.tool_choice, req.parallel_tool_calls,
                         (lambda: get_tool_parser(parser)) if parser else None, self.enable_auto_tool_choice)
        if mode.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the output itself: drop "
                                    f"{constraint_field}", param=constraint_field)
            constraint, constraint_field = mode.constraint, "tools"
        text, ids = await self.off_loop(self._chat_prompt, req.messages, req.add_generation_prompt,
                                        req.truncate_prompt_tokens, tools if mode.kind != "none" else None)
        if max_tokens is None:  # the room left, or less where generation_config.json says so
            max_tokens = max(1, min(self.max_model_len - len(ids), self.defaults.get("max_tokens", self.max_model_len)))
        extra: dict[str, Any] = {"skip_special_tokens": False} if mode.keeps_special_tokens else {}
        try:
            params = req.sampling_params(max_tokens=max_tokens, defaults=self.defaults,
                                         logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                         structured_outputs=constraint, prompt_logprobs=prompt_logprobs, **extra)
        except ValueError as e:
            raise from_value_error(e) from e
        await self.compile_constraint(params, constraint_field)
        self._check_length(len(ids), max_tokens, what="messages", max_tokens_name=limit_name)
        job = self._start([(text, ids)], params, req, "chatcmpl")
        envelope = Envelope(job.streams[0].request_id, "chat.completion", self.model_name)
        if req.stream:
            envelope.object = "chat.completion.chunk"
            return self._sse(self._chat_chunks(job, req, envelope, mode))
        finals = await self._collect(job, http)
        if finals is None:
            return JSONResponse({}, status_code=499)
        (out,) = finals
        choices = []
        role = self.chat_response_role(req)
        for c in out.outputs:
            message: dict[str, Any] = {"role": role, "content": c.text}
            finish = c.finish_reason
            if mode.kind != "none":
                parsed = mode.parse(c.text, final=True)
                if parsed.tools_called:
                    message = {"role": role, "content": parsed.content or None,
                               "tool_calls": message_tool_calls(parsed)}
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": ({"content": self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)}
                             if req.logprobs else None),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            })
        # vLLM's: the prompt's logprobs at the top level, when asked for.
        extra_fields = ({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                        if prompt_logprobs is not None else {})
        return envelope.body(choices, usage=self._usage(job), **extra_fields)

    def chat_response_role(self, req: ChatCompletionRequest) -> str:
        """The role of the reply, as vLLM: ``--response-role`` where the template adds a generation
        prompt, else the role of the last message (which the reply continues)."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

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

    async def _chat_chunks(self, job: Job, req: ChatCompletionRequest, envelope: Envelope,
                           mode: ToolMode | None = None) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        # Per choice: the tool calls sent so far, where the output may hold some.
        calls: dict[int, ToolCallStream] = {}
        usage_field: dict[str, Any] = {"usage": None} if req.include_usage else {}
        top_n = req.top_logprobs or 0

        def chunk(choice: dict[str, Any], completion_tokens: int) -> str:
            usage = self._chunk_usage(job, 0, completion_tokens) if req.continuous_usage else usage_field
            return envelope.chunk([choice], **usage)

        role = self.chat_response_role(req)
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
                if mode is not None and mode.kind != "none":
                    stream = calls.setdefault(c.index, ToolCallStream(mode))
                    finished = c.finish_reason is not None
                    for d in stream.deltas(visible, finished):
                        yield chunk({"index": c.index, "delta": d, "logprobs": None, "finish_reason": None},
                                    len(c.token_ids))
                    if finished:
                        st.finished = True
                        reason = "tool_calls" if stream.called and c.finish_reason == "stop" else c.finish_reason
                        yield chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                                     "stop_reason": c.stop_reason}, len(c.token_ids))
                    continue
                delta = visible[st.text_sent:]
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
            yield envelope.chunk([], usage=self._usage(job))
        yield "data: [DONE]\n\n"


def history_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: arguments as an object (they
    render it with ``tojson``), not the JSON text the API carries."""
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"messages[{index}].tool_calls[{k}] needs a function with a name, as in "
                                "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': '{}'}}",
                           param=f"messages.{index}.tool_calls")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else a template gets the text as it came
                args = json.loads(args) if args.strip() else {}
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out
