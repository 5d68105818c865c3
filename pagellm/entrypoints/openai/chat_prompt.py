"""From a chat request's messages to what a chat template reads, as vLLM builds it: the messages
(content as a string or as OpenAI's parts, ``--chat-template-content-format``), and the template's
arguments (``add_generation_prompt``, ``continue_final_message``, ``documents``,
``chat_template_kwargs``)."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatMessage

logger = logging.getLogger("pagellm.server")

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")
# Content parts read as text: OpenAI's text and refusal parts, and the Responses API's text items.
TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text", "output_text": "text"}
# Arguments of the tokenizer's apply_chat_template that are not the template's variables: from
# chat_template_kwargs they are dropped (with a warning), as vLLM drops them.
CALL_ARGUMENTS = frozenset({"conversation", "messages", "tools", "tokenize", "sanitize_control_tokens", "padding",
                            "truncation", "max_length", "return_tensors", "return_dict",
                            "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass
class TemplateOptions:
    """The arguments a chat request gives its template beyond messages and tools."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # the template's own variables (enable_thinking)


def template_options(add_generation_prompt: bool, continue_final_message: bool,
                     documents: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None,
                     messages: list[ChatMessage], reasoning_effort: str | None = None) -> TemplateOptions:
    """The options of a request; a 400 naming the field for the combinations vLLM refuses. As in
    vLLM, ``chat_template_kwargs`` may also set the three named arguments, and ``reasoning_effort``
    is one more template variable (where ``chat_template_kwargs`` does not set it)."""
    kwargs = {**({"reasoning_effort": reasoning_effort} if reasoning_effort is not None else {}), **(kwargs or {})}
    if "chat_template" in kwargs:
        raise APIError(400, "'chat_template_kwargs.chat_template' is not supported by this server: start it with "
                            "--chat-template instead", param="chat_template_kwargs")
    dropped = sorted(k for k in kwargs if k in CALL_ARGUMENTS)
    if dropped:
        logger.warning("chat_template_kwargs %s are not template variables: ignored", dropped)
    options = TemplateOptions(
        add_generation_prompt=bool(kwargs.pop("add_generation_prompt", add_generation_prompt)),
        continue_final_message=bool(kwargs.pop("continue_final_message", continue_final_message)),
        documents=kwargs.pop("documents", documents),
        kwargs={k: v for k, v in kwargs.items() if k not in CALL_ARGUMENTS},
    )
    if options.add_generation_prompt and options.continue_final_message:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: to continue the "
                            "last message, send \"add_generation_prompt\": false", param="continue_final_message")
    if options.continue_final_message and messages[-1].content in (None, "", []):
        raise APIError(400, "continue_final_message needs a last message with content to continue",
                       param="continue_final_message")
    return options


def conversation(messages: list[ChatMessage], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The messages as chat templates read them (400 naming the message for what they cannot hold)."""
    out = []
    for i, m in enumerate(messages):
        texts = message_texts(m.content, i)
        content: Any = ("\n".join(texts) if content_format == "string"
                        else [{"type": "text", "text": t} for t in texts])
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        entry: dict[str, Any] = {"role": role, "content": content}
        if m.audio is not None:
            raise APIError(400, f"messages[{i}].audio: audio is not supported by this server; remove it",
                           param=f"messages.{i}.audio")
        calls = m.tool_calls
        if not calls and m.function_call is not None:  # the deprecated single call: the same call
            calls = [{"id": f"call_{i}", "type": "function", "function": m.function_call}]
        if calls:
            entry["tool_calls"] = history_tool_calls(calls, i)
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None and role == "tool":
            entry["name"] = m.name
        # A reasoning model's earlier thinking: templates that show it read reasoning_content (Qwen3),
        # newer ones reasoning; either name gives both.
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thinking is not None and role == "assistant":
            entry["reasoning_content"] = entry["reasoning"] = thinking
        out.append(entry)
    return out


def message_texts(content: str | list[dict[str, Any]] | None, index: int) -> list[str]:
    """The texts of a message's content: a string, or text parts (anything else is a 400)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        kind = part.get("type")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise APIError(400, f"messages[{index}].content: content part type {kind!r} is not "
                                "supported; only text parts are", param=f"messages.{index}.content")
        if not isinstance(part.get(key), str):
            raise APIError(400, f"messages[{index}].content: a {kind} part needs a '{key}' string, as in "
                                f"{{'type': '{kind}', '{key}': 'Hello'}}", param=f"messages.{index}.content")
        texts.append(part[key])
    return texts


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


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block, parsed as its body (only the syntax tree is read)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _content_access(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """``node`` reads some message's content: ``x.content``, ``x['content']``, or a name set to one."""
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:  # message.content | list
        return _content_access(node.node, names)
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def detect_content_format(template: Any) -> ContentFormat:
    """vLLM's ``auto``: ``openai`` (a list of parts) where the template loops over a message's
    content, else ``string``."""
    if not isinstance(template, str):
        return "string"
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _Generation])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    names: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):  # {% set content = message['content'] %}
        if isinstance(assign.target, jinja2.nodes.Name) and _content_access(assign.node, names):
            names.add(assign.target.name)
    loops = tree.find_all(jinja2.nodes.For)
    return "openai" if any(_content_access(loop.iter, names) for loop in loops) else "string"


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``, read as vLLM reads it: a file's contents; else, where the text has a brace
    or a newline, the template itself, its backslash escapes decoded (a shell argument's ``\\n`` is a
    newline); anything else is a file that is missing."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif any(c in value for c in "{}\n"):
        # (Characters beyond Latin-1 go through as escapes, so that decoding keeps them.)
        template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template "
                         "(one with {{ ... }} or {% ... %})")
    # Compiled the way transformers renders it (its sandbox and extensions: break/continue, generation).
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse as Jinja (line {e.lineno}): {e.message}") from e
    return template
