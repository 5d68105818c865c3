"""The pooling runner's scheduler: encoder inputs keep no KV cache, so each is run whole, once, in one
step; a step takes waiting inputs in arrival order while their tokens fit the token budget (a long batch
of short documents fills it) and their count ``max_num_seqs``. Nothing is preempted: an input, once
scheduled, is finished by that step. An input alone longer than the budget runs alone."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class PoolingInput:
    """One input of a request: its tokens (and token types, for a text pair)."""

    request_id: str
    index: int  # the input's place in its request
    token_ids: list[int]
    token_type_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class PoolingScheduler:
    max_num_batched_tokens: int
    max_num_seqs: int
    waiting: deque[PoolingInput] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("the pooling scheduler needs a token budget and a batch size of at least 1")

    def add(self, item: PoolingInput) -> None:
        self.waiting.append(item)

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(i for i in self.waiting if i.request_id not in request_ids)

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> list[PoolingInput]:
        """The next batch: the oldest inputs whose tokens fit the budget (at least one)."""
        batch: list[PoolingInput] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            nxt = self.waiting[0]
            if batch and tokens + nxt.num_tokens > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += nxt.num_tokens
        return batch
