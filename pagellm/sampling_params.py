"""SamplingParams: how to pick the next tokens of one request, validated on creation."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

# The seeds torch.Generator.manual_seed accepts (a request's seed, and the engine's --seed).
SEED_RANGE = (-(2**63), 2**64 - 1)

# generation_config.json key -> SamplingParams field: the sampling defaults a checkpoint may ship
# (model/generation_config.py) and the keys --override-generation-config takes (vllm_args.py).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class RequestOutputKind(enum.Enum):
    """Which outputs a request yields: every step's cumulative state, or only the final one."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"

# Below this, temperature means greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5

# Bounds on one request's stop strings, so that one request cannot make every step costly for all:
# each step does a little work per stop string, and each stop string's table is built once. vLLM
# bounds the count only (VLLM_MAX_STOP_STRINGS, 4 by default, as OpenAI documents); 64 leaves room
# for clients that send more.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 65_536


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


NO_VALUE_MATCHES = ("{} is the JSON schema false, which no value matches: nothing could be generated; "
                    "give true or {{}} for any JSON value, or a schema object")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a JSON
    schema, as a dict or its text), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark, or
    GBNF as llama.cpp writes it) or ``json_object`` (any JSON object).

    Generated JSON has one space after ``:`` and ``,`` and no other whitespace between tokens: free
    whitespace would let a model pad forever. ``disable_any_whitespace``, ``disable_fallback`` and
    ``disable_additional_properties`` are accepted for vLLM's callers and change nothing here.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.json is True:  # the schema ``true``: any JSON value, as ``{}`` says
            self.json = {}
        elif self.json is False:
            raise ValueError(NO_VALUE_MATCHES.format("structured_outputs.json"))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or json_object, "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints, so a compiled grammar is shared by its requests."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
            return kind, spec
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))


@dataclass
class SamplingParams:
    """Sampling settings with vLLM's names and meanings.

    Invalid values raise ``ValueError`` naming the field, the value and the allowed range.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding: every sampled token keeps the output a prefix of a match.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thinking (structured_output/reasoning_gate.py): the tokens that end it (the
    # constraint holds only what follows them), and how many tokens it may take before they are forced.
    reasoning_end_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    # Filled in by validation: the normalised forms the engine uses.
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    # The stop strings' matching tables, built on first use and shared by the request's sequences
    # and streams (see StopStringMatcher).
    stop_tables: dict[str, list[int]] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._validate()
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:  # other filters cannot change an argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def scores_samples(self) -> bool:
        """Whether each sampled token's logprob is computed: where ``logprobs`` asks for it (then
        ``cumulative_logprob`` is reported, as in vLLM), or ``best_of`` ranks more samples than
        ``n`` by it."""
        return self.logprobs is not None or (self.best_of is not None and self.best_of > self.n)

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

    def clone(self, **changes: object) -> SamplingParams:
        fields = {k: getattr(self, k) for k, f in self.__dataclass_fields__.items() if f.init}
        fields.update(changes)
        return SamplingParams(**fields)  # type: ignore[arg-type]

    def _validate(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", self.best_of, f"an integer >= n ({self.n})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise bad(name, v, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", self.repetition_penalty, "a number in (0, 10] (1 disables it)")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "a number in [0, 100] (0 is greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a number in (0, 1] (1 disables it)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= 1, or 0 or -1 to disable it")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "a number in [0, 1] (0 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise bad("seed", self.seed, "an integer in [-2**63, 2**64 - 1] (what a torch generator takes) or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None: up to max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            # The upper limit is the engine's (--max-logprobs, 20 by default, as in vLLM).
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, v, "an integer >= 0 or None")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
            total = sum(len(s) for s in stops)
            if total > MAX_STOP_CHARS:
                raise ValueError(f"stop must have at most {MAX_STOP_CHARS} characters in all, got {total}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids)):
            raise bad("stop_token_ids", ids, "a list of non-negative token ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "True or False")
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "None when detokenize=False (stop strings are matched in the text)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", so, "a StructuredOutputsParams or None")
        end = self.reasoning_end_token_ids
        if end is not None and (not isinstance(end, list) or not end or not all(_is_int(t) and t >= 0 for t in end)):
            raise bad("reasoning_end_token_ids", end, "a non-empty list of token ids, or None")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise bad("thinking_token_budget", budget, "an integer >= 0, or None")
        if budget is not None and end is None:
            raise bad("thinking_token_budget", budget, "None unless reasoning_end_token_ids says where thinking ends "
                      "(the server sets it from --reasoning-parser)")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100 for k, v in bias.items())):
            raise bad("logit_bias", bias, "a dict of token id (>= 0) -> bias in [-100, 100]")
