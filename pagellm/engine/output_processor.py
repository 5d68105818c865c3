"""Output processing: each step's new tokens -> text (incremental detokenizing, stop strings) and
the ``RequestOutput`` a caller reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagellm.core.scheduler import TokenLogprobs
from pagellm.core.sequence import Request, Sequence, SequenceStatus
from pagellm.engine.detokenizer import StopStringMatcher
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling_params import RequestOutputKind

# Ends a sequence that a stop string completed (the scheduler's finish_seq).
FinishSeq = Callable[[Sequence, SequenceStatus], None]


class OutputProcessor:
    def __init__(self, tokenizer: Any, finish_seq: FinishSeq) -> None:
        self.tokenizer = tokenizer
        self.finish_seq = finish_seq
        # Decoding several tokens at once gives the streamed text unless the tokenizer cleans up spaces
        # around punctuation ("do" "n't"), which depends on where a decoded window starts.
        self.decode_at_end_matches_stream = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    def detokenize(self, seq: Sequence) -> None:
        """Add the text of the sequence's new tokens; end it where they complete a stop string."""
        params = seq.params
        if not params.detokenize:
            return
        if (params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings and not seq.is_finished
                and self.decode_at_end_matches_stream):
            return  # nobody reads the text before the end and no stop string needs it: decode once then
        pending = seq.output_token_ids[seq.detok.num_tokens:]
        ended_by_token = seq.status is SequenceStatus.FINISHED_STOPPED
        if ended_by_token and not params.include_stop_str_in_output:
            pending = pending[:-1]  # the EOS or stop token adds no text
            if not pending:
                return
        delta = seq.detok.add_tokens(pending)
        if seq.is_finished and not (ended_by_token and not params.include_stop_str_in_output):
            delta += seq.detok.flush()
        if not delta:
            return
        seq.text += delta
        if params.stop_strings:
            matcher = seq.detok.stop_matcher
            if matcher is None:
                matcher = seq.detok.stop_matcher = StopStringMatcher(params.stop_strings, params.stop_tables)
            # Fed every delta (before min_tokens too), so that it examines only the new text.
            hit = matcher.feed(delta)
            if hit is not None and not seq.is_finished and seq.num_output_tokens >= params.min_tokens:
                stop, idx = hit
                seq.text = seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
                seq.stop_reason = stop
                self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def _logprobs(
        self, entries: list[TokenLogprobs | None], converted: list[Any]
    ) -> list[dict[int, Logprob] | None]:
        """``entries`` as Logprob dicts; ``converted`` caches earlier calls, so each entry is decoded once."""
        decode = self.tokenizer.decode
        for e in entries[len(converted):]:
            converted.append(None if e is None else {t: Logprob(lp, rank, decode([t])) for t, (lp, rank) in e.items()})
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
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if params.scores_samples else None,
                    logprobs=(self._logprobs(seq.output_logprobs, seq.logprobs_out)  # type: ignore[arg-type]
                              if params.logprobs is not None else None),
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        m = request.metrics
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=(self._logprobs(request.prompt_logprobs, request.prompt_logprobs_out)
                             if request.wants_prompt_logprobs else None),
            outputs=completions,
            finished=request.is_finished,
            metrics=RequestMetrics(**vars(m)),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )
