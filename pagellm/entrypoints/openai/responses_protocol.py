"""OpenAI's Responses API (``POST /v1/responses``): the request body, and its translation into the chat
request that the chat path (template, structured outputs, tool calling) runs.

A Responses request is a chat request in other words: ``instructions`` is a system message, ``input``
items are messages (``function_call`` items an assistant's ``tool_calls``, ``function_call_output``
items tool messages), ``text.format`` is ``response_format``, tools are flat (``{"type": "function",
"name": ...}`` rather than nested under ``function``), ``max_output_tokens`` is
``max_completion_tokens``. Items are read by hand rather than by pydantic models, so that the fields
the API defines but that change nothing here (``id``, ``status``, ``annotations``, ``phase``...) pass,
and a problem is a 400 naming the item (``input.3.call_id``).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, ClassVar

from pydantic import Field, model_validator

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, StrictModel, note_ignored

# The ``include`` value that asks for the output text's logprobs (the others name data of hosted tools
# and of reasoning that this server never produces, so asking for them changes nothing).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    """An id in OpenAI's form: ``resp_``, ``msg_``, ``fc_`` then 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


class ResponsesRequest(StrictModel):
    """The body of ``POST /v1/responses``. Fields this server does not know are dropped with a warning
    before it validates (``tolerance.relax``, as for chat), or refused under ``--strict-requests``."""

    model: str | None = None
    input: str | list[Any] | None = None  # items are checked as they are translated, naming the item
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # {"include_obfuscation": ...}: no padding is sent
    store: bool | None = None  # default true: kept for GET and previous_response_id
    background: bool | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    # Accepted and ignored: they do not change what is generated (IGNORED).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None  # counts calls of hosted tools, which this server has none of
    # Declared only to be refused by name: they would change the output and are not implemented.
    conversation: Any | None = None
    prompt: Any | None = None
    context_management: Any | None = None
    # vLLM's sampling extensions, as on chat.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    cache_salt: str | None = None
    ignore_eos: bool | None = None

    IGNORED: ClassVar[tuple[str, ...]] = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                                          "service_tier", "max_tool_calls", "stream_options")
    REFUSED: ClassVar[tuple[str, ...]] = ("conversation", "prompt", "context_management")

    @model_validator(mode="after")
    def _note_ignored_fields(self) -> ResponsesRequest:
        for name in self.IGNORED:
            if name in self.model_fields_set:
                note_ignored(name)
        return self

    def check(self) -> None:
        """400 for what this server cannot do as asked (the shapes of items and tools are checked as
        they are translated)."""
        for name in self.REFUSED:
            if getattr(self, name) is not None:
                raise APIError(400, f"'{name}' is not supported by this server; remove it", param=name)
        if self.background:
            raise APIError(400, "background responses are not supported by this server: send background=false "
                                "(or leave it out) and wait for the answer, or stream it", param="background")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, f"truncation {self.truncation!r} is not supported by this server; only "
                                "'disabled' (an input over the context is a 400)", param="truncation")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise APIError(400, f"reasoning.effort must be a string such as 'low', got {effort!r}",
                           param="reasoning.effort")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, f"max_output_tokens must be an integer >= 1, got {self.max_output_tokens}",
                           param="max_output_tokens")
        if self.input is None and self.previous_response_id is None:
            raise APIError(400, "the field 'input' is required: a string, or a list of items such as "
                                "{'role': 'user', 'content': 'Hello'}", param="input")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


# ------------------------------------------------------------------ input items -> chat messages
def input_items(value: str | list[Any] | None) -> list[Any]:
    """``input`` as a list of items: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def _text_of(content: Any, param: str, allowed: tuple[str, ...]) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of content parts such as "
                            "{'type': 'input_text', 'text': 'Hello'}", param=param)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise APIError(400, f"{param}.{k}: content part type {kind!r} is not supported; this server takes "
                                f"{', '.join(allowed)} parts", param=f"{param}.{k}")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{param}.{k}: a {kind} part needs a string", param=f"{param}.{k}")
        texts.append(text)
    return "".join(texts)


_MESSAGE_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "assistant", "system", "developer")


def _need_str(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{param} needs '{key}' as a string", param=f"{param}.{key}")
    return value


def chat_messages(items: list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Responses items as chat messages: consecutive ``function_call`` items (and an assistant message
    just before them) make one assistant message with ``tool_calls``; a reasoning item's text is the
    next assistant message's ``reasoning_content`` (which the templates that show earlier thinking read)."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool message that answers it
    thinking: list[str] = []  # reasoning items' text, for the assistant message that follows them

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if thinking:
            message["reasoning_content"] = "".join(thinking)
            thinking.clear()
        return message

    for i, item in enumerate(items):
        at = f"{param}.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{at} must be an object such as {{'role': 'user', 'content': 'Hello'}}", param=at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{at}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{at}.role")
            message = {"role": role, "content": _text_of(item.get("content"), f"{at}.content", _MESSAGE_PARTS)}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            call_id, name = _need_str(item, "call_id", at), _need_str(item, "name", at)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _need_str(item, "arguments", at)}}
            names[call_id] = name
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = _need_str(item, "call_id", at)
            message = {"role": "tool", "tool_call_id": call_id,
                       "content": _text_of(item.get("output"), f"{at}.output", ("input_text", "output_text", "text"))}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind == "reasoning":
            text = reasoning_text(item, at)
            if text:
                thinking.append(text)
        else:
            raise APIError(400, f"{at}: input item type {kind!r} is not supported; this server takes message, "
                                "function_call, function_call_output and reasoning items", param=f"{at}.type")
    return messages


def reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary (encrypted content,
    which only OpenAI can read, is left aside)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise APIError(400, f"{param}.content must be a list of reasoning_text parts", param=f"{param}.content")
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


# ------------------------------------------------------------------ tools, tool_choice, text.format
def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's function tools in Responses' flat shape (chat's nested shape is read too)."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools.{i}: tool type {kind!r} is not supported; this server runs function tools "
                                "({'type': 'function', 'name': ..., 'parameters': {...}})", param=f"tools.{i}.type")
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools.{i} needs a 'name'", param=f"tools.{i}.name")
        out.append({"type": "function", "name": name, "description": fn.get("description"),
                    "parameters": fn.get("parameters"), "strict": fn.get("strict")})
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
            for t in tools]


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' ``tool_choice`` in chat's words: ``{"type": "function", "name": N}`` is chat's
    ``{"type": "function", "function": {"name": N}}``."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': NAME}; "
                        f"this server has no {choice.get('type')!r} tool choice", param="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (Responses' json_schema is flat: ``name`` and
    ``schema`` sit beside ``type``)."""
    if not text:
        return None
    if text.get("verbosity") is not None:
        raise APIError(400, "text.verbosity is not supported by this server; remove it", param="text.verbosity")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise APIError(400, f"text has unknown field(s) {unknown}; it takes 'format'", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object such as {'type': 'json_schema', 'name': 'answer', "
                            "'schema': {...}}", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="text.format.type")
    unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if unknown:
        raise APIError(400, f"text.format has unknown field(s) {unknown}", param="text.format")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]], tools: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat request that answers ``req``, ``history`` being the items of the response it follows."""
    messages = chat_messages(history, param="previous_response_id")
    messages += chat_messages(input_items(req.input))
    if req.instructions is not None:  # never carried over from a previous response, as in OpenAI's API
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise APIError(400, "the input is empty: give at least one message", param="input")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "tools": chat_tools(tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text),
        "stream": bool(req.stream),
        "stream_options": {"include_usage": True} if req.stream else None,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "reasoning_effort": (req.reasoning or {}).get("effort"),  # a chat template variable, as in vLLM
    }
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "priority", "cache_salt",
                 "ignore_eos"):
        body[name] = getattr(req, name)
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


# Chat's field names in the errors the chat path raises -> the Responses field the client sent.
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "messages": "input", "top_logprobs": "top_logprobs"}


def in_responses_terms(e: APIError) -> APIError:
    """An error of the chat path, naming the Responses fields rather than chat's."""
    message = e.message
    for chat_name, name in _CHAT_NAMES.items():
        if chat_name != name:
            message = message.replace(chat_name, name)
    param = e.param
    if param is not None:
        head, _, rest = param.partition(".")
        if head in _CHAT_NAMES:
            param = _CHAT_NAMES[head] + (f".{rest}" if rest and head != "messages" else "")
    return APIError(e.status, message, param=param, code=e.code, headers=e.headers)


# ------------------------------------------------------------------ the response object
# Chat's finish_reason -> the response's status and incomplete_details.reason.
_STATUS = {"stop": ("completed", None), "tool_calls": ("completed", None),
           "length": ("incomplete", "max_output_tokens"), "abort": ("cancelled", None), "error": ("failed", None)}


class ResponseDraft:
    """One response being made: its id, what it echoes of the request, and its final object."""

    def __init__(self, req: ResponsesRequest, tools: list[dict[str, Any]], model: str,
                 defaults: dict[str, Any]) -> None:
        self.req = req
        self.tools = tools
        self.model = model
        self.defaults = defaults
        self.id = new_id("resp")
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None = None,
             incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object, as OpenAI's API writes it."""
        req = self.req
        text_format = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {}, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default", "store": req.store is not False,
            "temperature": req.temperature if req.temperature is not None else self.defaults.get("temperature", 1.0),
            "text": {"format": text_format}, "tool_choice": req.tool_choice or "auto", "tools": self.tools,
            "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p if req.top_p is not None else self.defaults.get("top_p", 1.0),
            "truncation": "disabled", "usage": responses_usage(usage) if usage is not None else None,
            "user": req.user,
        }

    def final(self, output: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, int] | None,
              error: str | None = None) -> dict[str, Any]:
        """The finished response, from the chat choice's finish_reason (or the error that ended it)."""
        status, incomplete = _STATUS.get(finish_reason or "", ("completed", None))
        if error is None and finish_reason == "error":
            error = "the output reached a point where its constraint (text.format or tools) allows no token"
        if error is not None:
            status, incomplete = "failed", None
        for k, item in enumerate(output):  # only the last item can have been cut short
            item["status"] = "incomplete" if status != "completed" and k == len(output) - 1 else "completed"
        return self.body(status, output, usage, incomplete,
                         {"code": "server_error", "message": error} if error is not None else None)


def responses_usage(usage: dict[str, int]) -> dict[str, Any]:
    """Chat's usage in the Responses API's words."""
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(text: str, logprobs: list[dict[str, Any]] | None = None, status: str = "completed"
                 ) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
