"""JSON schemas for the constrained-decoding tests: nested objects, arrays, enums, required and
optional fields, $refs. Strings are bounded (maxLength, enum, pattern): a random-weight model picks
among whatever the grammar allows and would rarely close an unbounded string."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "boolean": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9,
                                                                                  "maximum": 9}},
              "required": ["kind", "x"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "handle": S}, "required": ["id", "handle"]}},
        "required": ["user"]},
    "deeply nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"enum": [1, 2, 3]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "array of enums": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"]},
    "array of objects": {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    "top-level array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50},
                        "minItems": 2, "maxItems": 5},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                 "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
                "required": ["zip", "code"]},
    "optional fields": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "b": {"type": "boolean"}, "c": S}, "required": ["a"]},
    "nullable": {"type": "object", "properties": {"note": {"anyOf": [S, {"type": "null"}]}}, "required": ["note"]},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                                   {"type": "boolean"}]}}, "required": ["value"]},
    "defs and refs": {"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string",
                                                                                  "pattern": "^[a-z]{3}[0-9]$"},
                                                                          "qty": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
                                         "required": ["sku", "qty"]}},
                      "type": "object", "properties": {"order": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                                 "minItems": 1, "maxItems": 2}},
                      "required": ["order"]},
    "enum of mixed types": {"type": "object", "properties": {"v": {"enum": ["on", "off", 0, 1, True, None]}},
                            "required": ["v"]},
    "string lengths": {"type": "object", "properties": {"short": {"type": "string", "minLength": 2, "maxLength": 4}},
                       "required": ["short"]},
    "integer range": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900,
                                                                "maximum": 2100}}, "required": ["year"]},
    "number range": {"type": "object", "properties": {"t": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["t"]},
    "object in array in object": {"type": "object", "properties": {"teams": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"enum": ["red", "blue"]}, "members": {
            "type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"n": S}, "required": ["n"]}}},
        "required": ["name", "members"]}}}, "required": ["teams"]},
    "many required": {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9}
                                                       for k in "abcdefgh"}, "required": list("abcdefgh")},
}

REGEXES = [r"\d{3}-\d{4}", r"(yes|no)", r"[a-z]{2,5}@[a-z]{3}\.(com|org)", r"#[0-9a-f]{6}",
           r"[A-Z][a-z]{1,6} [0-9]{1,3}"]
CHOICES = [["yes", "no"], ["red", "green", "blue"], ["positive", "negative", "neutral"], ["A", "B", "C", "D"]]


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required)}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _list(items: dict[str, Any], **bounds: int) -> dict[str, Any]:
    return {"type": "array", "items": items, **bounds}


# Schemas as applications write them (unbounded strings, numbers and arrays), each with the request
# that goes with it: a real model writes content, and may loop, where a random one writes noise.
EVERYDAY_SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (_obj({"name": STR, "age": INT}), "Describe a fictional person."),
    "city": (_obj({"city": STR, "country": STR, "population": INT}), "Tell me about Paris."),
    "tags": (_obj({"tags": _list(STR)}), "Give three tags for a blog post about cooking pasta."),
    "colors": (_obj({"colors": _list({"type": "string", "enum": ["red", "green", "blue"]})}),
               "List some primary colors."),
    "book": (_obj({"title": STR, "author": STR, "year": INT, "genres": _list(STR)}), "Describe a famous book."),
    "sentiment": (_obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": NUM}),
                  "Classify the sentiment: 'I love this product!'"),
    "address": (_obj({"street": STR, "city": STR, "zip": STR}), "Make up an address."),
    "user record": (_obj({"user": _obj({"id": INT, "email": STR}), "active": BOOL}), "Create a user record."),
    "todo list": (_obj({"items": _list(_obj({"task": STR, "done": BOOL}))}), "Write a todo list with two items."),
    "primes": (_list(INT), "List the first five prime numbers."),
    "weather": (_obj({"location": STR, "temperature": NUM, "unit": {"enum": ["celsius", "fahrenheit"]}}),
                "What's the weather in London?"),
    "movie review": (_obj({"title": STR, "rating": {"type": "number", "minimum": 0, "maximum": 10},
                           "actors": _list(STR, maxItems=3)}), "Review a movie."),
    "recipe": (_obj({"name": STR, "ingredients": _list(_obj({"item": STR, "quantity": STR})), "steps": _list(STR)}),
               "Give me a pancake recipe."),
    "yes or no": (_obj({"answer": BOOL, "reason": STR}), "Is the sky blue?"),
    "product": (_obj({"name": STR, "price": NUM, "in_stock": BOOL,
                      "category": {"enum": ["electronics", "books", "clothing"]}}), "Describe a laptop for sale."),
    "dated event": (_obj({"event": STR, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
                    "When did the moon landing happen?"),
    "optional nickname": (_obj({"name": STR}, {"nickname": STR}), "Name a famous scientist."),
    "matrix": (_obj({"rows": _list(_list(INT))}), "Give a 2x2 identity matrix."),
    "company": (_obj({"company": STR, "employees": _list(_obj({"name": STR, "role": STR}))}),
                "Describe a small startup with two employees."),
    "string or number": (_obj({"value": {"anyOf": [STR, INT]}}), "Give me a value."),
}
