"""The bounds on an output constraint, checked before any of it reaches the grammar engine.

The grammar engine is native code that recurses over the grammar: a constraint deep enough overflows
its stack and takes the process with it, and one large enough takes seconds to compile or to
compute each token's mask. What is plainly too large is refused here, with the limit and the flag
that raises it; what is merely suspicious is tried first in a probe process (compiler.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagellm.config import (
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_MASK_MS,
    DEFAULT_MAX_RULES,
)
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.text import plural

# The grammar engine keeps at most this many items in one row of its parser: every choice is one,
# so a longer choice list dead-ends after its first token.
MAX_CHOICES = 1999


@dataclass(frozen=True)
class ConstraintLimits:
    """``max_bytes``: the constraint's text (schema, grammar, regex, choices) at most this long;
    ``max_depth``: a JSON schema nested at most this deep, as written; ``compile_timeout``: the time
    one constraint may take to compile before the request is refused; ``max_mask_ms``: the CPU time
    one token's mask may cost (it is spent inside every step the request is in)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_rules: int = DEFAULT_MAX_RULES
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    max_mask_ms: float = DEFAULT_MAX_MASK_MS

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_rules"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{flag(name)} must be a positive integer, got {v!r}")
        for name in ("compile_timeout", "max_mask_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ValueError(f"{flag(name)} must be a positive number, got {v!r}")


def flag(name: str) -> str:
    """The server flag of a ConstraintLimits field."""
    return "--structured-outputs-" + name.replace("_", "-")


def constraint_text(so: StructuredOutputsParams) -> str:
    """The constraint as text, the way its size is counted."""
    if so.kind == "json":
        return so.json if isinstance(so.json, str) else json.dumps(so.json)
    if so.kind == "regex":
        return so.regex or ""
    if so.kind == "grammar":
        return so.grammar or ""
    if so.kind == "choice":
        return "\n".join(so.choice or ())
    return ""


# The start of a rule's definition in Lark (``name:``, ``?name.2:``) or GBNF (``name ::=``).
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.MULTILINE)


def count_rules(grammar: str) -> int:
    return len(_RULE.findall(grammar))


def json_depth(value: Any, stop_at: int) -> int:
    """How deeply ``value`` nests lists and objects (a scalar: 0), counted up to ``stop_at + 1``:
    iterative, so that any depth is measured without recursing."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > stop_at:
            return deepest
        stack.extend((c, depth) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_constraint(so: StructuredOutputsParams, limits: ConstraintLimits) -> None:
    """ValueError naming the first limit ``so`` exceeds and the flag that raises it."""
    size = len(constraint_text(so).encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise ValueError(f"the {so.kind} constraint is {plural(size, 'byte')} long, more than this server takes "
                         f"({limits.max_bytes}): simplify it, or start the server with a larger "
                         f"{flag('max_bytes')}")
    if so.kind == "choice" and len(so.choice or ()) > MAX_CHOICES:
        raise ValueError(f"choice lists {plural(len(so.choice or ()), 'option')}; the grammar engine follows at most "
                         f"{MAX_CHOICES} at once: narrow the list, or constrain with a regex or a JSON schema")
    if so.kind == "grammar":
        rules = count_rules(so.grammar or "")
        if rules > limits.max_rules:
            raise ValueError(f"the grammar defines {plural(rules, 'rule')}, more than this server takes "
                             f"({limits.max_rules}): simplify it, or start the server with a larger "
                             f"{flag('max_rules')}")
    if so.kind == "json":
        schema: Any = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        depth = json_depth(schema, limits.max_depth)
        if depth > limits.max_depth:
            raise ValueError(f"the JSON schema nests objects and lists more than {limits.max_depth} levels deep: "
                             f"flatten it (use $defs and $ref), or start the server with a larger "
                             f"{flag('max_depth')}")
