"""A request's output constraint from its API fields: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` and its older ``guided_*`` names."""

from __future__ import annotations

from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.sampling_params import NO_VALUE_MATCHES, StructuredOutputsParams

# vLLM's StructuredOutputsParams fields a request body may set.
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                     "disable_fallback", "disable_additional_properties", "whitespace_pattern")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object`` or ``json_schema``."""
    kind = rf.get("type", "text")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise APIError(400, f"response_format has unknown field(s) {extra}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format of type 'json_schema' needs a 'json_schema' object such as "
                            "{'name': 'answer', 'schema': {...}, 'strict': true}", param="response_format.json_schema")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise APIError(400, f"response_format.json_schema has unknown field(s) {unknown}",
                       param="response_format.json_schema")
    if "name" in spec and not isinstance(spec["name"], str):
        raise APIError(400, "response_format.json_schema.name must be a string", param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any JSON object
    if schema is True:  # any JSON value
        schema = {}
    if schema is False:
        raise APIError(400, NO_VALUE_MATCHES.format("response_format.json_schema.schema"),
                       param="response_format.json_schema.schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"response_format.json_schema.schema must be a JSON schema object (or true), got "
                            f"{type(schema).__name__}", param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)


def from_structured_outputs(so: dict[str, Any], param: str = "structured_outputs") -> StructuredOutputsParams:
    unknown = sorted(set(so) - set(STRUCTURED_FIELDS))
    if unknown:
        raise APIError(400, f"{param} has unknown field(s) {unknown}; it takes {list(STRUCTURED_FIELDS)}",
                       param=param)
    fields = {k: v for k, v in so.items() if v is not None and k != "whitespace_pattern"}
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param) from e


def request_constraint(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field that gave it) of a completion or chat request; at most one field may."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if req.response_format is not None:
        so = from_response_format(req.response_format)
        if so is not None:
            found.append((so, "response_format"))
    if req.structured_outputs is not None:
        found.append((from_structured_outputs(req.structured_outputs), "structured_outputs"))
    guided = {v: getattr(req, k) for k, v in GUIDED_FIELDS.items() if getattr(req, k) is not None}
    if guided:
        found.append((from_structured_outputs(guided, param=next(k for k in GUIDED_FIELDS if getattr(req, k)
                                                                     is not None)), "guided_*"))
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not several: {[name for _, name in found]}",
                       param=found[1][1])
    return found[0] if found else (None, None)
