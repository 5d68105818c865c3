"""Request bodies read as vLLM reads them, before the strict models validate them.

Clients replay what they received and send what other servers take: ``null`` on optional fields,
``4.0`` for an integer, fields of newer API versions. vLLM's lax parsing accepts all of these; here the
models stay strict (a wrong type is a 400 naming it) and this pass does what vLLM's laxness does:

- ``null`` on a field that takes no null means unset (the field's default);
- a float with no fractional part on an integer field is that integer (``max_tokens: 4.0``);
- a field no model declares is dropped and named in one warning per request (vLLM logs "fields were
  present in the request but ignored"), unless the server runs with ``--strict-requests``, which
  keeps them for the models to refuse with a 400, as before;
- the fields a router adds to every request it forwards (``ROUTER_DEFAULTS``: ``vllm-router`` and
  SGLang's router fill in SGLang's fields) are dropped without a word, even under ``--strict-requests``,
  while they hold the value that changes nothing.
"""

from __future__ import annotations

import functools
import logging
import types
import typing
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger("pagellm.server")

# Fields vllm-router adds to each completion and chat body it forwards, at their defaults: these values
# ask for what pagellm does anyway (stop strings trimmed, no hidden states, reasoning split as parsed).
ROUTER_DEFAULTS: dict[str, Any] = {"no_stop_trim": False, "return_hidden_states": False,
                                   "separate_reasoning": True, "stream_reasoning": True}


@functools.cache
def _shape(annotation: Any) -> tuple[bool, bool, type[BaseModel] | None, bool]:
    """(takes null, takes an integer but no float, the model a value is, whether a list of it)."""
    members = _members(annotation)
    takes_none = type(None) in members or Any in members
    ints = int in members and float not in members and bool not in members
    for member in members:
        if isinstance(member, type) and issubclass(member, BaseModel):
            return takes_none, ints, member, False
        origin = typing.get_origin(member)
        if origin is list:
            (item,) = typing.get_args(member) or (Any,)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return takes_none, ints, item, True
    return takes_none, ints, None, False


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types a union (``X | None``, ``Optional[X]``) allows; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def relax(model: type[BaseModel], data: Any, strict: bool, path: str = "") -> list[str]:
    """Rewrite ``data`` (a parsed JSON body for ``model``) in place as above; the dotted names of the
    unknown fields dropped (none when ``strict``: the model then refuses them)."""
    if not isinstance(data, dict):
        return []
    dropped: list[str] = []
    fields = model.model_fields
    for key in list(data):
        value = data[key]
        field = fields.get(key)
        if field is None:
            if not path and key in ROUTER_DEFAULTS and value is ROUTER_DEFAULTS[key]:
                del data[key]
            elif not strict:
                dropped.append(path + key)
                del data[key]
            continue
        takes_none, ints, inner, is_list = _shape(field.annotation)  # type: ignore[arg-type]
        if value is None and not takes_none:
            del data[key]  # null: unset, so the default applies
        elif ints and isinstance(value, float) and value.is_integer():
            data[key] = int(value)
        elif inner is not None and is_list and isinstance(value, list):
            for i, item in enumerate(value):
                dropped += relax(inner, item, strict, f"{path}{key}.{i}.")
        elif inner is not None and not is_list:
            dropped += relax(inner, value, strict, f"{path}{key}.")
    return dropped


def log_dropped(route: str, dropped: list[str]) -> None:
    """The one warning of a request whose unknown fields were dropped."""
    if dropped:
        logger.warning("a request to %s had fields this server does not know, ignored: %s "
                       "(--strict-requests refuses them instead)", route, ", ".join(repr(d) for d in dropped))
