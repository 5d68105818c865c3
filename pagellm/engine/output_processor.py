"""Output processing: each step's new tokens -> text (incremental detokenizing, stop strings) and
the ``RequestOutput`` a caller reads.

Everything about text and presentation lives here, not in core: per sequence, its detokenizer, text,
stop-string matcher and converted logprobs (``SeqOutputState``); per request, its prompt logprobs.
Both are keyed weakly by the core objects, so they go when core (and the caller) drop them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

from pagellm.core.runner_output import ModelRunnerOutput, TokenLogprobs
from pagellm.core.sequence import Request, Sequence, SequenceStatus
from pagellm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagellm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagellm.sampling_params import RequestOutputKind

# Ends a sequence that a stop string completed (the scheduler's finish_seq).
FinishSeq = Callable[[Sequence, SequenceStatus], None]


class SeqOutputState:
    """One sequence's presentation state: its text so far and what makes it."""

    def __init__(self, tokenizer: Any, seq: Sequence) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, seq.request.prompt_token_ids, seq.params.skip_special_tokens)
        self.text = ""
        # The sequence's stop-string search, kept across steps (None until a stop string needs it).
        self.stop_matcher: StopStringMatcher | None = None
        # seq.output_logprobs already converted (once each, so a long stream with logprobs costs
        # linear, not quadratic, work).
        self.logprobs: SampleLogprobs = []


class OutputProcessor:
    def __init__(self, tokenizer: Any, finish_seq: FinishSeq) -> None:
        self.tokenizer = tokenizer
        self.finish_seq = finish_seq
        # Decoding several tokens at once gives the streamed text unless the tokenizer cleans up spaces
        # around punctuation ("do" "n't"), which depends on where a decoded window starts.
        self.decode_at_end_matches_stream = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._seq_states: weakref.WeakKeyDictionary[Sequence, SeqOutputState] = weakref.WeakKeyDictionary()
        # Per request: its prompt logprobs, converted, None first (the first token has none).
        self._prompt_logprobs: weakref.WeakKeyDictionary[Request, PromptLogprobs] = weakref.WeakKeyDictionary()

    def state(self, seq: Sequence) -> SeqOutputState:
        """``seq``'s presentation state, made on first use."""
        state = self._seq_states.get(seq)
        if state is None:
            state = self._seq_states[seq] = SeqOutputState(self.tokenizer, seq)
        return state

    def text(self, seq: Sequence) -> str:
        """The text of ``seq`` so far ("" before any)."""
        state = self._seq_states.get(seq)
        return state.text if state is not None else ""

    def add_prompt_logprobs(self, result: ModelRunnerOutput, seqs: Mapping[int, Sequence]) -> None:
        """Keep the prompt logprobs the runner computed this step (call before ``Scheduler.update``:
        the chunks of sequences still running, as the scheduler counts them); ``seqs``: the
        scheduler's sequences by id."""
        for seq_id, entries in result.prompt_logprobs.items():
            seq = seqs[seq_id]
            if not entries or seq.status is not SequenceStatus.RUNNING:
                continue
            request = seq.request
            converted = self._prompt_logprobs.get(request)
            if converted is None:
                converted = self._prompt_logprobs[request] = [None]  # the first token has no logprob
            converted.extend(self._convert(entries))

    def detokenize(self, seq: Sequence) -> None:
        """Add the text of the sequence's new tokens; end it where they complete a stop string."""
        params = seq.params
        if not params.detokenize:
            return
        if (params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings and not seq.is_finished
                and self.decode_at_end_matches_stream):
            return  # nobody reads the text before the end and no stop string needs it: decode once then
        state = self.state(seq)
        detok = state.detok
        pending = seq.output_token_ids[detok.num_tokens:]
        # A stop token, or the EOS a dead-ended constraint forced: neither adds text.
        ended_by_token = seq.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_ERROR)
        if ended_by_token and not params.include_stop_str_in_output:
            pending = pending[:-1]  # the EOS or stop token adds no text
            if not pending:
                return
        delta = detok.add_tokens(pending)
        if seq.is_finished and not (ended_by_token and not params.include_stop_str_in_output):
            delta += detok.flush()
        if not delta:
            return
        state.text += delta
        if params.stop_strings:
            matcher = state.stop_matcher
            if matcher is None:
                matcher = state.stop_matcher = StopStringMatcher(params.stop_strings, params.stop_tables)
            # Fed every delta (before min_tokens too), so that it examines only the new text.
            hit = matcher.feed(delta)
            if hit is not None and not seq.is_finished and seq.num_output_tokens >= params.min_tokens:
                stop, idx = hit
                state.text = state.text[: idx + len(stop)] if params.include_stop_str_in_output else state.text[:idx]
                seq.stop_reason = stop
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def _convert(self, entries: list[TokenLogprobs]) -> SampleLogprobs:
        """``entries`` as Logprob dicts."""
        decode = self.tokenizer.decode
        return [{t: Logprob(lp, rank, decode([t])) for t, (lp, rank) in e.items()} for e in entries]

    def _logprobs(self, seq: Sequence) -> SampleLogprobs:
        """``seq``'s output logprobs as Logprob dicts, converting only those not converted yet."""
        converted = self.state(seq).logprobs
        converted.extend(self._convert(seq.output_logprobs[len(converted):]))
        return list(converted)

    def make_output(self, request: Request) -> RequestOutput:
        """The request as a caller sees it now (the ``n`` best samples once ``best_of`` is done)."""
        params = request.sampling_params
        seqs = request.seqs
        if params.best_of and params.best_of > params.n and request.is_finished:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = []
        for i, seq in enumerate(seqs):
            completions.append(
                CompletionOutput(
                    index=i,
                    text=self.text(seq),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if params.scores_samples else None,
                    logprobs=self._logprobs(seq) if params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        m = request.metrics
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=(list(self._prompt_logprobs.get(request, ()))
                             if request.wants_prompt_logprobs else None),
            outputs=completions,
            finished=request.is_finished,
            metrics=RequestMetrics(**vars(m)),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )
