"""The bounds on an output constraint, checked before any of it reaches the grammar engine.

The grammar engine is native code that recurses over the grammar: a constraint deep enough overflows
its stack and takes the process with it, and one large enough takes seconds to compile or to
compute each token's mask. What is plainly too large is refused here, with the limit and the flag
that raises it; what is merely suspicious is tried first in a probe process (compiler.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagellm.constraint_limits import ConstraintLimits, constraint_flag
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.text import plural

# The grammar engine keeps at most this many items in one row of its parser: every choice is one,
# so a longer choice list dead-ends after its first token.
MAX_CHOICES = 1999


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
                         f"{constraint_flag('max_bytes')}")
    if so.kind == "choice" and len(so.choice or ()) > MAX_CHOICES:
        raise ValueError(f"choice lists {plural(len(so.choice or ()), 'option')}; the grammar engine follows at most "
                         f"{MAX_CHOICES} at once: narrow the list, or constrain with a regex or a JSON schema")
    if so.kind == "grammar":
        rules = count_rules(so.grammar or "")
        if rules > limits.max_rules:
            raise ValueError(f"the grammar defines {plural(rules, 'rule')}, more than this server takes "
                             f"({limits.max_rules}): simplify it, or start the server with a larger "
                             f"{constraint_flag('max_rules')}")
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
                             f"{constraint_flag('max_depth')}")
