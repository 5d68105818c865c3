"""vLLM's ``speculative_config`` (``LLM(speculative_config=...)``, ``--speculative-config``), checked
where the engine's arguments are: the keys that apply to pagellm's n-gram drafts
(``core/speculation.py`` proposes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys that apply: ``method`` (``ngram``), ``num_speculative_tokens``,
    ``prompt_lookup_max`` / ``prompt_lookup_min`` (the n-gram lengths tried, longest first), and
    ``disable_by_batch_size`` (no drafts in a step with more running sequences than this: a step that
    many rows wide is bound by compute, where verifying drafts costs what they save)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """The configuration of a ``speculative_config`` mapping; ValueError naming what is wrong."""
        where = "speculative_config (--speculative-config)"
        data = dict(raw)
        if "model" in data and data.get("method") in (None, "draft_model"):
            raise ValueError(f"{where}: speculation with a draft model is not supported yet; use "
                             """{"method": "ngram", "num_speculative_tokens": 4}""")
        method = data.pop("method", None) or ("ngram" if "prompt_lookup_max" in data or "prompt_lookup_min" in data
                                              else None)
        if method not in METHODS:
            raise ValueError(f"{where}: method must be one of {', '.join(METHODS)}, got {method!r}")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; the n-gram method takes "
                             f"{', '.join(sorted(known))}")
        k = data.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"{where}: num_speculative_tokens must be an integer from 1 to 32, got {k!r}")
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        # As vLLM: one given sets the other; neither, both 5.
        lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo or 5)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{where}: {name} must be an integer from 1 to 64, got {value!r}")
        if lo > hi:
            raise ValueError(f"{where}: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        batch = data.get("disable_by_batch_size")
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
            raise ValueError(f"{where}: disable_by_batch_size must be a positive integer, got {batch!r}")
        return cls(k, method, hi, lo, batch)
