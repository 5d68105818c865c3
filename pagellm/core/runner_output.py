"""What the model runner hands back each step, to the scheduler (samples) and to the engine's output
processor (logprobs); as vLLM's ``v1/outputs.py``. Plain data: no torch, so core can import it."""

from __future__ import annotations

from dataclasses import dataclass, field

# {token_id: (logprob, rank)}; rank 1 is the most likely token.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the unprocessed distribution; None where the request scores nothing
    top_logprobs: TokenLogprobs | None = None


@dataclass
class ModelRunnerOutput:
    samples: dict[int, SampleResult] = field(default_factory=dict)
    # Speculative decoding: seq_id -> the tokens kept after ``samples``' one, in order (the accepted
    # drafts but the first, and the token sampled where the first was rejected or after the last).
    extra_samples: dict[int, list[SampleResult]] = field(default_factory=dict)
    # seq_id -> logprobs of the prompt tokens at the positions asked for in this step
    # (``ScheduledSeq.prompt_logprobs_range``); read by the engine's output processor only.
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # seq_id -> why its output can no longer satisfy its constraint (its grammar dead-ended this step):
    # the scheduler ends it with finish_reason "error".
    constraint_errors: dict[int, str] = field(default_factory=dict)
    # (group, block id) of each read from the KV tier on disk (``DiskMoves.loads``) that failed (a file
    # gone, torn or unreadable): the scheduler forgets the block and recomputes it.
    disk_load_failures: list[tuple[int, int]] = field(default_factory=list)
