"""``POST /v1/completions``: prompts -> engine requests -> OpenAI's text_completion JSON or SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from pagellm.entrypoints.openai.errors import APIError, from_value_error
from pagellm.entrypoints.openai.prompt_logprobs import prompt_logprobs_json, requested_prompt_logprobs
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.entrypoints.openai.serving import ChoiceState, Envelope, Job, OpenAIServing
from pagellm.entrypoints.openai.serving_beam_search import beam_search_completion
from pagellm.entrypoints.openai.structured import request_constraint
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.text import plural


class OpenAIServingCompletion(OpenAIServing):
    async def completions(self, req: CompletionRequest, http: HTTPRequest) -> Any:
        self.check_model(req.model)
        self._check_fields(req)
        if req.use_beam_search:
            return await beam_search_completion(self, req, http, lambda: self._completion_prompts(
                req.prompt, req.add_special_tokens, req.truncate_prompt_tokens))
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server; remove it", param="suffix")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {req.max_tokens}", param="max_tokens")
        self.check_logprobs("logprobs", req.logprobs)
        prompt_logprobs = requested_prompt_logprobs(self, req)
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is allowed only with echo, to score a prompt)",
                           param="max_tokens")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(400, f"best_of ({req.best_of}) > n ({req.n}) cannot be streamed: which samples are the "
                                "best is known only at the end; drop stream or best_of", param="best_of")
        constraint, constraint_field = request_constraint(req)
        prompts = await self._completion_prompts(req.prompt, req.add_special_tokens, req.truncate_prompt_tokens)
        # Left out, max_tokens is the model's generation_config.json max_new_tokens, else OpenAI's 16.
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else self.defaults.get("max_tokens", 16)
        try:
            params = req.sampling_params(
                max_tokens=1 if echo_only else max_tokens,
                defaults=self.defaults,
                best_of=req.best_of,
                logprobs=req.logprobs,
                # As vLLM: an echo's logprobs are the prompt's, prompt_logprobs of them when given.
                prompt_logprobs=(prompt_logprobs if prompt_logprobs is not None
                                 else req.logprobs if req.echo and req.logprobs is not None else None),
                structured_outputs=None if echo_only else constraint,
            )
        except ValueError as e:
            raise from_value_error(e) from e
        await self.compile_constraint(params, constraint_field)
        for _, ids in prompts:
            if echo_only and len(ids) >= self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {plural(self.max_model_len, 'token')}, "
                                    f"but the prompt has {len(ids)}: to score a prompt with echo it must be shorter",
                               param="prompt", code="context_length_exceeded")
            self._check_length(len(ids), params.max_tokens or 1)
        job = self._start(prompts, params, req, "cmpl")
        envelope = Envelope(job.streams[0].request_id, "text_completion", self.reported_model(req.model))
        if req.stream:
            return self._sse(self._completion_chunks(job, req, envelope, echo_only))
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
        return envelope.body(choices, usage=usage)

    async def _completion_prompts(self, prompt: Any, add_special_tokens: bool = True,
                                  truncate: int | None = None) -> list[tuple[str, list[int]]]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        limit = self.engine.max_waiting_requests
        if limit is not None and len(items) > limit:
            raise APIError(400, f"{len(items)} prompts in one request, but the server queues at most "
                                f"{plural(limit, 'request')}: send them in smaller batches", param="prompt")
        return await self.off_loop(self._tokenize_all, items, add_special_tokens, truncate)

    def _tokenize_all(self, items: list[Any], add_special_tokens: bool = True,
                      truncate: int | None = None) -> list[tuple[str, list[int]]]:
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
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        entries: list[tuple[int, dict[int, Logprob] | None]] = []
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
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": "length" if echo_only else c.finish_reason, "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None and not req.stream:  # (a stream refuses them)
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return choice

    async def _completion_chunks(self, job: Job, req: CompletionRequest, envelope: Envelope,
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
                    yield envelope.chunk([choice], **usage_field)
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
                yield envelope.chunk([choice], **usage_field)
        if req.include_usage:
            usage = self._usage(job)
            if echo_only:
                usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
            yield envelope.chunk([], usage=usage)
        yield "data: [DONE]\n\n"

