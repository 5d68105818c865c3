"""vLLM's ``speculative_config`` (``LLM(speculative_config=...)``, ``--speculative-config``), checked
where the engine's arguments are: the keys that apply to pagellm's n-gram drafts (``core/speculation.py``
proposes them) and to a draft model's (``worker/draft_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
WHERE = "speculative_config (--speculative-config)"
NGRAM_KEYS = frozenset({"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"})
DRAFT_KEYS = frozenset({"model", "num_speculative_tokens", "disable_by_batch_size", "quantization", "revision",
                        "draft_tensor_parallel_size"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys that apply: ``method`` (``ngram``, or ``draft_model``, implied
    by ``model``), ``num_speculative_tokens``, ``prompt_lookup_max`` / ``prompt_lookup_min`` (the n-gram
    lengths tried, longest first), ``model`` (the draft model: a smaller one with the target's
    tokenizer), its ``quantization`` and hub ``revision``, and ``disable_by_batch_size`` (no drafts in a
    step with more running sequences than this: a step that many rows wide is bound by compute, where
    verifying drafts costs what they save)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None
    model: str | None = None
    quantization: str | None = None
    revision: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """The configuration of a ``speculative_config`` mapping; ValueError naming what is wrong."""
        data = dict(raw)
        method = data.pop("method", None) or ("draft_model" if "model" in data else "ngram"
                                              if "prompt_lookup_max" in data or "prompt_lookup_min" in data
                                              else None)
        if method not in METHODS:
            raise ValueError(f"{WHERE}: method must be one of {', '.join(METHODS)} (or give a draft \"model\"), "
                             f"got {method!r}")
        known = DRAFT_KEYS if method == "draft_model" else NGRAM_KEYS
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{WHERE}: unknown key(s) {', '.join(map(repr, unknown))}; the {method} method takes "
                             f"{', '.join(sorted(known))}")
        k = data.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"{WHERE}: num_speculative_tokens must be an integer from 1 to 32, got {k!r}")
        batch = data.get("disable_by_batch_size")
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
            raise ValueError(f"{WHERE}: disable_by_batch_size must be a positive integer, got {batch!r}")
        if method == "draft_model":
            return cls._draft(data, k, batch)
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        # As vLLM: one given sets the other; neither, both 5.
        lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo or 5)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{WHERE}: {name} must be an integer from 1 to 64, got {value!r}")
        if lo > hi:
            raise ValueError(f"{WHERE}: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return cls(k, method, hi, lo, batch)

    @classmethod
    def _draft(cls, data: dict[str, Any], k: int, batch: int | None) -> SpeculativeConfig:
        model = data.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"{WHERE}: the draft_model method needs \"model\": the path or hub id of a smaller "
                             f"model with the target's tokenizer, got {model!r}")
        tp = data.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"{WHERE}: draft_tensor_parallel_size must be 1 (the draft runs in the engine's "
                             f"process), got {tp!r}")
        for key in ("quantization", "revision"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"{WHERE}: {key} must be a string, got {data[key]!r}")
        return cls(k, "draft_model", disable_by_batch_size=batch, model=model, quantization=data.get("quantization"),
                   revision=data.get("revision"))
