"""Logits processors and sampling, vectorised over the sequences sampled in a step."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagellm.core.runner_output import SampleResult, TokenLogprobs
from pagellm.kernels import native
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output.bitmask import GrammarMask, apply_token_bitmask
from pagellm.worker.request_state import SeqState


def top_logprobs(
    logprobs: torch.Tensor, num: int, chosen: torch.Tensor
) -> list[TokenLogprobs]:
    """Per row: the ``num`` most likely tokens plus the chosen one, each with (logprob, rank).

    logprobs: (rows, vocab); chosen: (rows,) token ids.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # (rows, 1)
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    out: list[TokenLogprobs] = []
    if num > 0:
        vals, ids = logprobs.topk(num, dim=1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
    for r, (tok, lp, rank) in enumerate(zip(chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist())):
        entry: TokenLogprobs = {}
        if num > 0:
            for k, (t, v) in enumerate(zip(ids_l[r], vals_l[r])):
                entry[t] = (v, k + 1)
        entry[tok] = (lp, rank)
        out.append(entry)
    return out


class Sampler:
    """Turns the last-position logits of each sampled sequence into its next token."""

    def __init__(self, eos_token_ids: Iterable[int], device: torch.device, seed: int) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for unseeded requests
        self._seeded: dict[int, torch.Generator] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self._seeded.pop(sid, None)

    def __call__(self, logits: torch.Tensor, seqs: list[SeqState],
                 grammar: GrammarMask | None = None) -> list[SampleResult]:
        """logits: (num_seqs, vocab) float32, one row per sequence in ``seqs``; ``grammar``: the tokens
        the constrained rows may sample, applied after every other processor."""
        raw = logits
        params = [s.params for s in seqs]
        processed_all = any(_needs_processing(s) for s in seqs)
        if processed_all:
            logits = self._process(logits.clone(), seqs)
        if grammar is not None and grammar.rows:
            if logits is raw:
                logits = logits.clone()
            apply_token_bitmask(logits, grammar, unprocessed=raw if processed_all else None)
        # Chosen tokens' logprobs only where some request asks for them (as in vLLM): without, a
        # greedy step needs just the argmax, not a pass of exponentials over every logit.
        scored = [p.scores_samples for p in params]
        # The raw logits' argmax (and logsumexp) in one pass per row, where the native kernel applies.
        greedy = [p.is_greedy for p in params]
        fast = native.argmax_logsumexp(raw, with_lse=any(scored)) if any(greedy) or any(scored) else None
        chosen = None if all(greedy) else self._sample(logits, seqs)
        if any(greedy):
            if fast is not None and logits is raw:
                top = fast[0]
            elif fast is not None and not processed_all and grammar is not None:
                # Only the constrained rows changed: the rest keep the raw argmax.
                g_rows = torch.tensor(grammar.rows, device=logits.device)
                top = fast[0].index_copy(0, g_rows, logits.index_select(0, g_rows).argmax(dim=-1))
            else:
                top = logits.argmax(dim=-1)
            chosen = top if chosen is None else torch.where(torch.tensor(greedy, device=logits.device), top, chosen)
        assert chosen is not None  # seqs is never empty: every row is greedy or sampled
        return self._results(raw, chosen, params, fast)

    def verify(self, logits: torch.Tensor, seq: SeqState, drafts: list[int],
               draft_probs: torch.Tensor | None = None) -> list[SampleResult]:
        """Speculative decoding: ``logits`` (len(drafts) + 1, vocab) are the rows of ``seq``'s last token
        and of its drafts; returns the tokens kept, each with its row's logprobs: the drafts while they
        are what sampling would give, then one token more. Greedy rows keep a draft equal to their
        argmax (the tokens are those of decoding one at a time). Sampled rows accept draft d with
        probability min(1, p(d) / q(d)) and else sample from max(p - q, 0) (rejection sampling), which
        leaves every kept token distributed as p; ``draft_probs`` (len(drafts), vocab) is q, the draft
        model's distribution each draft was drawn from; None: a draft certain of its token (n-grams)."""
        rows = [seq] * logits.shape[0]
        if seq.params.is_greedy:
            results = self(logits, rows)
            kept = 1
            while kept <= len(drafts) and drafts[kept - 1] == results[kept - 1].token_id:
                kept += 1
            return results[:kept]
        probs = self._probs(logits, rows)
        gen = self.generator if seq.seed is None else self._generator_for(seq)
        tokens: list[int] = []
        for i, draft in enumerate(drafts):
            u = torch.rand(1, dtype=torch.float64, device=logits.device, generator=gen).item()
            q = 1.0 if draft_probs is None else draft_probs[i, draft].item()
            if u * q < probs[i, draft].item():
                tokens.append(draft)
                continue
            residual = probs[i : i + 1].clone()
            if draft_probs is None:
                residual[0, draft] = 0.0
            else:
                residual = (residual - draft_probs[i : i + 1]).clamp_min_(0.0)
                if not bool(residual.sum() > 0):  # (p == q up to rounding: p itself)
                    residual = probs[i : i + 1]
            tokens.append(int(self._draw(residual, [seq])[0]))
            break
        else:
            tokens.append(int(self._draw(probs[-1:], [seq])[0]))
        kept_rows = logits[: len(tokens)]
        fast = native.argmax_logsumexp(kept_rows, with_lse=True) if seq.params.scores_samples else None
        return self._results(kept_rows, torch.tensor(tokens, device=logits.device), [seq.params] * len(tokens), fast)

    def propose(self, logits: torch.Tensor, seqs: list[SeqState]) -> tuple[list[int], torch.Tensor | None]:
        """A draft model's tokens, one per row of ``logits`` (one per sequence of ``seqs``): the argmax for
        greedy sequences, else drawn from the sequence's sampling distribution q, returned too (rows of
        greedy sequences unused; None when every sequence is greedy)."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if not sampled:
            return tokens.tolist(), None
        rows = torch.tensor(sampled, device=logits.device)
        probs = torch.zeros_like(logits)
        probs[rows] = self._probs(logits[rows], [seqs[i] for i in sampled])
        tokens[rows] = self._draw(probs[rows], [seqs[i] for i in sampled])
        return tokens.tolist(), probs

    def _results(self, raw: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams],
                 fast: tuple[torch.Tensor, torch.Tensor | None] | None) -> list[SampleResult]:
        """Each row's chosen token with the logprobs its request asks for (of the unprocessed logits
        ``raw``; ``fast``: their native argmax and logsumexp, computed where some row is scored)."""
        scored = [p.scores_samples for p in params]
        tokens = chosen.tolist()
        if not any(scored):
            return [SampleResult(t, None) for t in tokens]
        # The chosen tokens' logprobs, of the unprocessed distribution.
        lse = None if fast is None else fast[1]
        if lse is not None:
            chosen_lp = (raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - lse).tolist()
        else:
            # log_softmax + gather: faster on CPU than torch.logsumexp, which makes several passes.
            raw_logprobs = torch.log_softmax(raw, dim=-1)
            chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        # (Rows that score nothing get None whatever their neighbours ask: outputs do not depend on the batch.)
        results = [SampleResult(t, lp if s else None) for t, lp, s in zip(tokens, chosen_lp, scored)]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            num = max(params[i].logprobs or 0 for i in want)
            rows = torch.tensor(want, device=raw.device)
            wanted = raw[rows] - lse[rows].unsqueeze(1) if lse is not None else raw_logprobs[rows]
            tops = top_logprobs(wanted, num, chosen[rows])
            for i, entry in zip(want, tops):
                n_i = params[i].logprobs or 0
                keep = {t: v for t, v in entry.items() if v[1] <= n_i or t == tokens[i]}
                results[i].top_logprobs = keep
        return results

    # ------------------------------------------------------------ processors
    def _process(self, logits: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
        vocab = logits.shape[1]
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < vocab])
                logits[row, ids.to(logits.device)] += vals.to(logits.device)
            if seq.num_output_tokens < p.min_tokens:
                stoppers = (*(p.stop_token_ids or ()), *([] if p.ignore_eos else self.eos_token_ids))
                banned = [t for t in stoppers if t < vocab]
                # Banning every token would leave nothing to sample (an id outside the vocabulary):
                # the engine refuses such requests; one that slips through is not banned at all
                # rather than fail everyone's step.
                if banned and len(set(banned)) < vocab:
                    logits[row, banned] = float("-inf")
        self._apply_penalties(logits, seqs)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[SeqState]) -> None:
        rows = [i for i, s in enumerate(seqs) if _penalised(s.params)]
        if not rows:
            return
        vocab = logits.shape[1]
        dev = logits.device
        for i in rows:
            p = seqs[i].params
            out_ids = torch.tensor(seqs[i].output_token_ids, dtype=torch.long, device=dev)
            counts = torch.zeros(vocab, device=dev).index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float))
            row = logits[i]
            if p.repetition_penalty != 1.0:
                # Applies to prompt and output tokens alike (as in vLLM and transformers).
                seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
                seen[torch.tensor(seqs[i].prompt_token_ids, dtype=torch.long, device=dev)] = True
                seen |= counts > 0
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            row -= p.frequency_penalty * counts
            row -= p.presence_penalty * (counts > 0).float()

    def _sample(self, logits: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
        return self._draw(self._probs(logits, seqs), seqs)

    def _probs(self, logits: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, min_p, top_k and top_p applied."""
        dev = logits.device
        params = [s.params for s in seqs]
        temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev).unsqueeze(1)
        logits = logits / temps
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((min_p > 0).any()):
            probs = logits.softmax(-1)
            threshold = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        return logits.softmax(-1)

    def _draw(self, probs: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
        """One token per row of ``probs`` (weights; rows need not sum to 1).

        Inverse CDF: one uniform draw per row, the first token whose cumulative probability exceeds
        it. (The exponential race, argmax(p / q) with q ~ Exp(1), needs a draw per vocabulary entry,
        which costs as much as the rest of a decode step.) Seeded sequences draw from their own
        generator, so their tokens never depend on batch companions."""
        dev = probs.device
        u = torch.empty(len(seqs), dtype=torch.float64, device=dev)
        unseeded = [i for i, s in enumerate(seqs) if s.seed is None]
        if unseeded:
            u[torch.tensor(unseeded, device=dev)] = torch.rand(
                len(unseeded), dtype=torch.float64, device=dev, generator=self.generator)
        for i, s in enumerate(seqs):
            if s.seed is not None:
                u[i] = torch.rand(1, dtype=torch.float64, device=dev, generator=self._generator_for(s))
        cdf = probs.double().cumsum(dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so that some token's cumulative probability exceeds it; "right"
        # skips zero-probability tokens (their cumulative value equals their predecessor's).
        target = torch.minimum(u.unsqueeze(1) * total, total * (1 - 2**-52))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _generator_for(self, seq: SeqState) -> torch.Generator:
        gen = self._seeded.get(seq.seq_id)
        if gen is None:
            assert seq.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.seed)
            self._seeded[seq.seq_id] = gen
        return gen


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _needs_processing(seq: SeqState) -> bool:
    """Whether any logits processor changes this sequence's logits this step (the grammar's mask
    aside: it is applied on its own rows only)."""
    p = seq.params
    return bool(p.logit_bias) or seq.num_output_tokens < p.min_tokens or _penalised(p)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    mask = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    probs = sorted_logits.softmax(-1)
    cum = probs.cumsum(-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays.
    drop = (cum - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

