"""Beam search on top of the engine, sharing KV blocks through the prefix cache.

Each step, every live beam asks the engine for one token with the top ``2 * beam_width``
logprobs; the best ``beam_width`` continuations over all beams survive. A beam's
request starts with its parent's tokens, so it adopts the parent's full blocks from
the prefix cache (expanding a beam forks those blocks, only the partial tail block
is recomputed) and a pruned beam's blocks are simply freed, to be evicted LRU.

Scoring follows transformers: a finished beam scores ``cum_logprob / gen_len ** length_penalty``,
where ``gen_len`` counts generated tokens. A candidate that ends in EOS finishes only if it
ranks within the top ``beam_width`` candidates of its step (as in transformers). The search
stops after ``max_tokens`` steps, or earlier once ``beam_width`` beams have finished and no
live beam can still beat the worst of them (transformers' ``early_stopping=False`` heuristic).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine, PromptType
    from pagellm.outputs import Logprob

# SamplingParams caps logprobs at 20: 2 * beam_width candidates per beam.
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or not (
                1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool)
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    finished: bool = False
    text: str | None = None
    score: float = 0.0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def _score(beam: BeamSearchSequence, length_penalty: float) -> float:
    gen_len = max(1, len(beam.tokens) - beam.num_prompt_tokens)
    return beam.cum_logprob / (gen_len**length_penalty)


class BeamSearch:
    """The search over some prompts, one step at a time, apart from how each step's requests run:
    ``beam_search`` runs them on an ``LLMEngine``, the server on its async engine (the same requests,
    hence the same beams)."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.params = params
        self.width = params.beam_width
        # Each step's request of one beam: its next token with the top 2 * beam_width logprobs.
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.width, ignore_eos=True,
                                          detokenize=False)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.max_model_len = max_model_len
        self.live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(t), len(t))] for t in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def next_jobs(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every beam to extend this step; empty when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        self.steps += 1
        for p, beams in enumerate(self.live):  # a beam that fills max_model_len is finished (by length)
            full = [b for b in beams if len(b.tokens) >= self.max_model_len]
            if full:
                self.done[p].extend(full)
                self.live[p] = [b for b in beams if len(b.tokens) < self.max_model_len]
        return [(p, beam) for p, beams in enumerate(self.live) for beam in beams]

    def advance(self, jobs: list[tuple[int, BeamSearchSequence]], entries: list[dict[int, Logprob]]) -> None:
        """Keep the best continuations of ``jobs``, given each job's next-token logprobs."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (p, beam), entry in zip(jobs, entries):
            for token, lp in entry.items():
                candidates[p].append(
                    BeamSearchSequence(beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + lp.logprob)
                )
        width = self.width
        for p, cands in enumerate(candidates):
            cands.sort(key=lambda b: b.cum_logprob, reverse=True)
            next_beams: list[BeamSearchSequence] = []
            for rank, cand in enumerate(cands[: 2 * width]):
                if cand.tokens[-1] in self.eos:
                    if rank < width:  # an EOS outside the top beam_width is dropped
                        cand.finished = True
                        self.done[p].append(cand)
                    continue
                next_beams.append(cand)
                if len(next_beams) == width:
                    break
            self.live[p] = next_beams
            if _search_is_done(self.done[p], next_beams, width, self.params.length_penalty):
                self.live[p] = []

    def outputs(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """The ``beam_width`` best sequences of each prompt, best first, with their text."""
        outputs = []
        for p in range(len(self.live)):
            finished = self.done[p] + self.live[p]
            for beam in finished:
                beam.score = _score(beam, self.params.length_penalty)
                beam.text = tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)
            finished.sort(key=lambda b: b.score, reverse=True)
            outputs.append(BeamSearchOutput(finished[: self.width]))
        return outputs


def beam_search(engine: LLMEngine, prompts: list[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
    tokens = []
    for prompt in prompts:
        _, ids = engine.tokenize_prompt(prompt)
        engine.check_prompt_length(len(ids))
        tokens.append(ids)
    search = BeamSearch(tokens, params, engine.eos_token_ids, engine.max_model_len)
    counter = itertools.count()
    while jobs := search.next_jobs():
        added = []
        try:
            for _, beam in jobs:
                rid = f"beam-{next(counter)}"
                engine.add_request(rid, beam.tokens, search.step_params)
                added.append(rid)
            results = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            engine.abort_request(added)
            raise
        search.advance(jobs, [results[rid].outputs[0].logprobs[0] for rid in added])  # type: ignore[index]
    return search.outputs(engine.tokenizer)


def _search_is_done(done: list[BeamSearchSequence], live: list[BeamSearchSequence], width: int,
                    length_penalty: float) -> bool:
    if not live:
        return True
    if len(done) < width:
        return False
    worst_done = sorted((_score(b, length_penalty) for b in done), reverse=True)[width - 1]
    best_live = max(_score(b, length_penalty) for b in live)
    return best_live <= worst_done
