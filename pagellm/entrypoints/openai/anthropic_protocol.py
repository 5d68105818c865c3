"""Anthropic's Messages API: request bodies (pydantic), their translation into a chat completion
request (so they run on the chat path: template, tools, parsers), and errors in Anthropic's shape.

Content blocks and tools stay plain dicts in the bodies and are checked while translating, so that a
block of a kind not served here is a 400 naming its type and position rather than a union's list of
mismatches.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, note_ignored

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                                                else "api_error"), "message": message}}


def is_anthropic_path(path: str) -> bool:
    """The routes whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: what the prompt of a Messages request would be."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # format: a JSON schema the answer follows (structured outputs); effort: ignored (no reasoning here).
    output_config: dict[str, Any] | None = None
    # Accepted and ignored: they change nothing that is generated here.
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}: the server's --reasoning-parser.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None

    IGNORED: ClassVar[tuple[str, ...]] = ("cache_control", "speed", "user_profile_id", "workspace_id")


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and ignored: they change nothing that is generated.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    # Refused by name.
    container: Any | None = None
    context_management: Any | None = None

    IGNORED: ClassVar[tuple[str, ...]] = (*CountTokensRequest.IGNORED, "metadata", "service_tier", "inference_geo",
                                          "diagnostics")


REFUSED = {
    "mcp_servers": "'mcp_servers' is not supported by this server (it calls no MCP server); remove it",
    "container": "'container' is not supported by this server (it runs no code); remove it",
    "context_management": "'context_management' is not supported by this server; remove it",
}


def check_refused(req: CountTokensRequest) -> None:
    """400 naming the first field given that would change the answer and is not served here."""
    for name, message in REFUSED.items():
        if getattr(req, name, None) is not None:
            raise APIError(400, message, param=name)
    for name in req.IGNORED:
        if name in req.model_fields_set:
            note_ignored(name)


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of a list of text blocks (``system``, a tool result's ``content``)."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for k, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{k}]: only text blocks ({{'type': 'text', 'text': ...}}) are supported "
                                f"here, got type {block.get('type')!r}", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's ``system`` and ``messages`` as chat messages: ``tool_use`` blocks become the
    assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages (before the user's text)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, block in enumerate(m.content):
            kind = block.get("type")
            at = f"{where}.{k}"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise APIError(400, f"{at}: a text block needs a 'text' string", param=at)
                texts.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise APIError(400, f"{at}: a tool_use block needs an 'id' and a 'name'", param=at)
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise APIError(400, f"{at}: a tool_use block's 'input' must be an object", param=at)
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(arguments)}})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}: a tool_result block needs the 'tool_use_id' it answers", param=at)
                content = block.get("content", "")
                if not isinstance(content, (str, list)):
                    raise APIError(400, f"{at}: a tool_result's 'content' is a string or a list of text blocks",
                                   param=at)
                text = _text_of(content, f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning: not part of what the template renders
            else:
                raise APIError(400, f"{at}: content blocks of type {kind!r} are not supported in {m.role} messages "
                                    "here (text, tool_use in assistant messages, tool_result in user messages)",
                               param=at)
        if texts or calls or not any(b.get("type") == "tool_result" for b in m.content):
            message: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise APIError(400, f"tools.{i}: tools of type {kind!r} (Anthropic's server tools) are not supported "
                                "here; give custom tools with a name and an input_schema", param=f"tools.{i}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools.{i}: a tool needs a 'name'", param=f"tools.{i}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(400, f"tools.{i}: a tool needs an 'input_schema' object (a JSON schema)",
                           param=f"tools.{i}.input_schema")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as chat's, and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return ("auto" if tools else "none"), parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or "
                        f"{{'type': 'tool', 'name': ...}}, got {choice!r}", param="tool_choice")


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": {...}}``) as chat's ``response_format``."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """The chat fields of Anthropic's ``thinking``: enabled, the thinking is shown (as thinking blocks)
    and ``budget_tokens`` bounds it; disabled, the template is asked not to think (Qwen3's
    ``enable_thinking``); not given, a reasoning model's thinking is left out of the answer."""
    if thinking is None:
        return {"include_reasoning": False}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"include_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}}
    if kind != "enabled":
        raise APIError(400, f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", param="thinking.type")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise APIError(400, f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
                       param="thinking.budget_tokens")
    return {"include_reasoning": True, **({"thinking_token_budget": budget} if budget is not None else {})}


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that generates ``req``'s answer."""
    check_refused(req)
    tools = _chat_tools(req.tools)
    tool_choice, parallel = _chat_tool_choice(req.tool_choice, tools)
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req), "n": 1}
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    response_format = _response_format(req.output_config)
    if response_format is not None:
        body["response_format"] = response_format
    body.update(_thinking(req.thinking))
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return ChatCompletionRequest.model_validate(body, strict=False)
