"""What the structured-output code reads of a sampled sequence (the model runner's state of it)."""

from __future__ import annotations

from typing import Protocol

from pagellm.sampling_params import SamplingParams


class ConstrainedSeq(Protocol):
    """What the manager reads of a sampled sequence (the model runner's state of it)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
