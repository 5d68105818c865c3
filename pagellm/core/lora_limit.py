"""vLLM's rule for LoRA adapters in a step: at most ``max_loras`` distinct adapters among the running
sequences; a waiting sequence of another adapter waits (those behind it may go first)."""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.core.sequence import Sequence


def adapter_ids(seqs: Iterable[Sequence]) -> set[int]:
    """The ``lora_int_id`` of each adapter ``seqs`` run with."""
    return {s.request.lora_request.lora_int_id for s in seqs if s.request.lora_request is not None}


def adapter_names(seqs: Iterable[Sequence]) -> list[str]:
    """The names of the adapters ``seqs`` run with, sorted (vLLM's ``lora_requests_info`` labels)."""
    return sorted({s.request.lora_request.lora_name for s in seqs if s.request.lora_request is not None})


def lora_fits(seq: Sequence, running: set[int], max_loras: int | None) -> bool:
    """Whether ``seq`` may join sequences running ``running`` adapters without passing ``max_loras``."""
    lora = seq.request.lora_request
    return lora is None or max_loras is None or lora.lora_int_id in running or len(running) < max_loras
