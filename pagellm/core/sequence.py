"""Requests and their sequences, and the status machine they move through."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.token_lists import TokenLists
from pagellm.outputs import RequestMetrics

if TYPE_CHECKING:  # core stays importable without torch
    from pagellm.lora.request import LoRARequest
    from pagellm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The output can no longer satisfy the request's constraint (the grammar engine dead-ended).
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
            SequenceStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_seq_counter = itertools.count()


def child_seed(seed: int, index: int) -> int:
    """The sampling seed of child ``index`` of a request seeded with ``seed``: siblings differ.

    A single-sample request with this seed reproduces that child's tokens.
    """
    return seed if index == 0 else (seed * 1_000_003 + index) % 2**63


class Sequence(TokenLists):
    """One generated continuation of a prompt: the unit the scheduler and cache see.

    ``num_computed_tokens`` counts the tokens whose K/V is in the cache; the
    scheduler hands out ``num_tokens - num_computed_tokens`` more each step (a
    whole prompt, a prefill chunk, or the one newest token of a decode).
    """

    def __init__(self, request: Request, index: int, seed: int | None) -> None:
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.seed = seed
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        # Per output token: {token_id: (logprob, rank)} when logprobs were asked for.
        self.output_logprobs: list[dict[int, tuple[float, int]]] = []
        self.stop_reason: int | str | None = None
        # Why the output can no longer satisfy the request's constraint (set by the grammar's mask).
        self.constraint_error: str | None = None
        # (hash, key) of each full block, filled lazily by the KV cache manager.
        self.block_keys: list[tuple[int, tuple]] = []
        # Prefix-cache hit of the first admission, in tokens (RequestOutput.num_cached_tokens).
        self.num_cached_tokens = 0
        self.was_admitted = False

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(eq=False)
class Request:
    """A user request: one prompt, ``n`` sequences, and what was asked of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Latency targets in seconds (the sla policy); None: the engine's defaults.
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    # Isolates tenants in the prefix cache: blocks are shared only between requests with the same salt.
    cache_salt: str | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    seqs: list[Sequence] = field(default_factory=list)
    # Children of an n > 1 request that fork from seqs[0] when its prompt is done.
    pending_children: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)
    # Prompt positions whose next-token logprob has been computed (prompt logprobs): positions
    # [0, this) are done; the entries themselves go to the engine's output processor.
    num_scored_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        seed = self.sampling_params.seed
        n = self.sampling_params.best_of or self.sampling_params.n
        self.seqs = [Sequence(self, i, None if seed is None else child_seed(seed, i)) for i in range(n)]
        self.pending_children = self.seqs[1:]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None
