"""The grammar engine behind constrained decoding: llguidance (see docs/architecture.md for why).

A constraint (``StructuredOutputsParams``) becomes an llguidance grammar and then a *template* matcher,
built once per distinct constraint; each sequence gets a copy of it, advanced by its own tokens. The
library is imported on first use, so that the CLI's help and unconstrained serving never load it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from pagellm.sampling_params import NO_VALUE_MATCHES, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Generated JSON is laid out as json.dumps lays it out: free whitespace between tokens would let a
# model pad a document forever (one of the known failure modes of constrained JSON).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    import llguidance

    return llguidance


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties``
    and says nothing about others (OpenAI's strict mode requires it written out; here it is the
    default): a model may otherwise add keys for as long as it likes. The outputs remain valid
    under the original schema."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (close_objects(v) if k not in ("const", "enum", "default", "examples") else v)
           for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


# The largest integers the engine takes in a JSON schema: lengths become regex repetitions (32-bit
# counts), every other integer must fit in 64 bits.
LENGTH_KEYWORDS = ("minLength", "maxLength")
MAX_LENGTH = 2**32 - 1
MAX_INTEGER = 2**63 - 1


def check_integers(schema: Any, path: str = "") -> None:
    """ValueError naming the first integer of ``schema`` the engine cannot take (its path and limit)."""
    items = schema.items() if isinstance(schema, dict) else enumerate(schema) if isinstance(schema, list) else ()
    for k, v in items:
        where = f"{path}.{k}" if path else str(k)
        if isinstance(v, int) and not isinstance(v, bool):
            limit = MAX_LENGTH if k in LENGTH_KEYWORDS else MAX_INTEGER
            if not -limit - 1 <= v <= limit:
                shown = str(v) if len(str(v)) <= 30 else f"an integer of {len(str(v))} digits"
                raise ValueError(f"the JSON schema's '{where}' is {shown}, beyond the limit of "
                                 f"{'-' if v < 0 else ''}{limit if v > 0 else limit + 1}; use a smaller value")
        elif isinstance(v, (dict, list)):
            check_integers(v, where)


# Errors of a valid schema that uses keywords (or formats) the engine does not implement: such a schema
# is compiled again with them ignored rather than refused (what is implemented still holds).
UNIMPLEMENTED = ("Unimplemented keys", "Unknown format")


def grammar_text(params: StructuredOutputsParams, lenient: bool = False) -> str:
    """The llguidance grammar of a constraint; ValueError naming what is malformed. ``lenient``: JSON
    schema keywords the engine does not implement are ignored."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind = params.kind
    if kind == "json":
        schema: Any = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        if schema is True:  # any JSON value
            schema = {}
        if schema is False:
            raise ValueError(NO_VALUE_MATCHES.format("the JSON schema"))
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object (or true), got {type(schema).__name__}")
        check_integers(schema)
        options = {**JSON_OPTIONS, "lenient": True} if lenient else JSON_OPTIONS
        return str(matcher.grammar_from_json_schema(close_objects(schema), defaults=options))
    if kind == "json_object":
        return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if kind == "regex":
        return str(matcher.grammar_from_regex(params.regex))
    if kind == "choice":
        # Each choice as a literal: quoted with JSON escapes, which Lark string literals share.
        return str(matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or ())))
    assert kind == "grammar"
    text = params.grammar or ""
    try:
        return str(llg.grammar_from("grammar", text))  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"the grammar is not valid Lark or GBNF: {e}") from e


class GuidanceGrammar:
    """One sequence's matcher, how many of its output tokens it has consumed, and from which of them
    on its document wraps up (see wrap_up.py)."""

    __slots__ = ("matcher", "num_tokens", "wrap_up_from", "close_estimate")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_tokens = 0
        self.wrap_up_from: int | None = None
        self.close_estimate: int | None = None  # tokens the wrap-up took from the state last looked at

    def advance(self, tokens: list[int]) -> None:
        """Bring the matcher to the end of ``tokens`` (the sequence's output so far): consume the new
        ones, or roll back those no longer there. The state is a function of the tokens alone, so a
        preempted sequence (swapped, or recomputed from its tokens) resumes exactly where it was.
        Tokens after the grammar's end (``ignore_eos``) are not the grammar's: they are not consumed."""
        n = len(tokens)
        if self.wrap_up_from is not None and n < self.wrap_up_from:
            self.wrap_up_from = None
        if n < self.num_tokens:
            self.close_estimate = None
            if not self.matcher.rollback(self.num_tokens - n):
                self.matcher = None  # (cannot happen: rollback is bounded by the tokens consumed)
        elif n > self.num_tokens and not self.matcher.is_stopped():
            self.matcher.consume_tokens(tokens[self.num_tokens:])
        elif n > self.num_tokens:
            return  # the count stays at the grammar's end, where a rollback must find it
        self.num_tokens = n

    @property
    def failed(self) -> bool:
        """The grammar dead-ended: no output from here on can satisfy it (a limit of the grammar engine
        was hit, it refused a token, or it stopped where the output is incomplete). Only EOS can follow."""
        m = self.matcher
        return m is None or bool(m.is_error()) or (bool(m.is_stopped()) and not m.is_accepting())

    @property
    def error(self) -> str:
        """Why the grammar failed, in one line."""
        if self.matcher is None:
            return "the grammar failed"
        return str(self.matcher.get_error()).split("\n")[0] or f"no way on ({self.matcher.stop_reason()})"


class GuidanceBackend:
    """llguidance over one tokenizer: matchers of grammars (compiler.py decides which), and batches'
    token bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None

    @property
    def tokenizer(self) -> Any:
        """The llguidance view of the vocabulary: built once (a server builds it as it starts)."""
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def matcher(self, grammar: str) -> Any:
        """A matcher at the start of ``grammar`` (an llguidance grammar from ``grammar_text``); in the
        error state, saying why, if the grammar engine refuses it."""
        return _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)

    @staticmethod
    def new_grammar(template: Any) -> GuidanceGrammar:
        """A fresh matcher at the grammar's start (copying the template skips its construction)."""
        return GuidanceGrammar(template.deep_copy())

    @property
    def executor(self) -> Any:
        if self._executor is None:
            # A few threads: masks are filled while the model's forward pass holds the other cores.
            self._executor = _llguidance().LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 4)))
        return self._executor

    def fill_bitmask(self, grammars: list[tuple[GuidanceGrammar, int]], bitmask: Any) -> None:
        """For each (grammar, row): that row of ``bitmask`` (a contiguous int32 CPU tensor, one bit per
        token) := the tokens the grammar allows next."""
        if grammars:
            rows, words = bitmask.shape
            self.executor.unsafe_compute_mask_ptr([(g.matcher, i) for g, i in grammars],
                                                  bitmask.data_ptr(), words * 4, rows)
