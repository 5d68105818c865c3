"""What the engine returns: RequestOutput and CompletionOutput, as vLLM users know them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 is the most likely token
    decoded_token: str | None = None


# One dict per token position: {token_id: Logprob} (the top N plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()``) of a request's life, plus how often it was preempted."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ pooling (--runner pooling)
# vLLM's pooling outputs. Their values are plain lists of floats (vLLM's PoolingOutput.data is a tensor).
@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One input's pooled output (``outputs.data``); ``prompt_token_ids`` the tokens the model ran."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data), out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ScoringRequestOutput:
        return cls(out.request_id, ScoringOutput(out.outputs.data[0]), out.prompt_token_ids, out.finished)
