"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "service_unavailable",
    500: "internal_server_error",
}


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI-shaped JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


_TYPE_WORDS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
               "bool": ("a boolean", "booleans")}


def _describe(tag: str, plural: bool = False) -> str:
    """A union member's tag in pydantic's errors ('str', 'list[int]', 'dict[str,any]') in words."""
    if tag in _TYPE_WORDS:
        return _TYPE_WORDS[tag][plural]
    if tag.startswith("list[") and tag.endswith("]"):
        return ("lists of " if plural else "a list of ") + _describe(tag[5:-1], plural=True)
    if tag.startswith("dict["):
        return "objects" if plural else "an object"
    return tag


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_WORDS or "[" in part)


def _union_error(errors: Sequence[Mapping[str, Any]]) -> APIError | None:
    """One message for a field that takes several types (``prompt``, ``stop``, a message's ``content``):
    pydantic reports a failure per member, and the first alone names a member, not the field."""
    if errors[0].get("type") == "extra_forbidden":  # an unknown key may well be spelled "str"
        return None
    loc = tuple(errors[0].get("loc", ()))
    at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if at is None:
        return None
    field, tags, value = loc[:at], [], None
    for err in errors:
        other = tuple(err.get("loc", ()))
        if other[:at] == field and len(other) > at and _is_union_tag(other[at]):
            if other[at] not in tags:
                tags.append(other[at])
            if len(other) == at + 1:  # this member's check saw the field's whole value
                value = err.get("input")
    if len(tags) < 2:  # not a union after all: a dict key the client chose, like logit_bias {"int": ...}
        return None
    words = [_describe(t) for t in tags]
    expected = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    name = ".".join(str(p) for p in field)
    shown = "null" if value is None else type(value).__name__ if isinstance(value, (dict, list)) else repr(value)
    return APIError(400, f"invalid value for '{name}': expected {expected} (got {shown})", param=name)


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem of a pydantic error, phrased for a person, with the field as ``param``."""
    errors = e.errors()
    union = _union_error(errors)
    if union is not None:
        return union
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg')}; send a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{loc}': this server does not accept it; remove it", param=loc)
    if kind == "missing":
        return APIError(400, f"the field '{loc}' is required", param=loc)
    if kind == "model_type" and not loc:
        return APIError(400, "the body must be a JSON object")
    value = first.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return APIError(400, f"invalid value for '{loc}': {first.get('msg')} (got {shown})", param=loc or None)


# SamplingParams errors start with the field's name: use it as `param`.
def from_value_error(e: ValueError) -> APIError:
    message = str(e)
    head = message.split(" ", 1)[0]
    param = head if head.isidentifier() and head.islower() else None
    return APIError(400, message, param=param)
