"""StructuredOutputManager: compiles constraints (cached by their text), keeps each constrained
sequence's grammar state (by sequence id, until the sequence finishes), and fills a step's token
bitmask while the model runs.

Requests without ``structured_outputs`` never reach the grammar engine: a step with no constrained
sequence costs one scan of its sequences' parameters. A reasoning model's constraint holds only what
follows its thinking, and a thinking budget forces the thinking's end (``reasoning_gate.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagellm.constraint_limits import ConstraintLimits
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceBackend, GuidanceGrammar
from pagellm.structured_output.bitmask import GrammarMask, allocate_bitmask, set_only
from pagellm.structured_output.compiler import ConstraintCompiler, Refused
from pagellm.structured_output.reasoning_gate import ReasoningGate, gated
from pagellm.structured_output.seq_view import ConstrainedSeq
from pagellm.structured_output.wrap_up import (
    LOOKAHEAD,
    RECHECK,
    SLACK,
    WRAP_UP_KINDS,
    WrapUpMasks,
    is_looping,
    tokens_left,
)

logger = logging.getLogger(__name__)

# Compiled constraints kept: a service sees a few schemas many times (its tools, its extractors).
DEFAULT_CACHE_SIZE = 256


def needs_mask(params: SamplingParams) -> bool:
    """Whether a request's tokens are ever masked: a constraint, or a thinking budget."""
    return params.structured_outputs is not None or (
        params.thinking_token_budget is not None and bool(params.reasoning_end_token_ids))


def tokenizer_size(tokenizer: Any) -> int:
    """How many ids ``tokenizer`` has, added tokens included (0 where it cannot say)."""
    try:
        return len(tokenizer)
    except TypeError:
        return 0


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], max_model_len: int,
                 cache_size: int = DEFAULT_CACHE_SIZE, limits: ConstraintLimits | None = None) -> None:
        # The grammar's vocabulary covers every id the model can produce (an embedding padded past the
        # tokenizer) and every id the tokenizer has (transformers may add tokens past a checkpoint's
        # embedding, which llguidance must still know): masks are cut to the logits when applied.
        self.vocab_size = max(vocab_size, tokenizer_size(tokenizer))
        self.max_model_len = max_model_len
        self._wrap_up_masks: WrapUpMasks | None = None
        self.eos_token_ids = sorted(eos_token_ids)
        self.backend = GuidanceBackend(tokenizer, self.vocab_size, self.eos_token_ids)
        self.compiler = ConstraintCompiler(self.backend, limits)
        self.cache_size = cache_size
        # Compiled constraints by their text, and those refused (with why): a client that repeats a
        # constraint the server refused is answered at once rather than tried again.
        self._templates: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        # Admission compiles on the compile thread while the engine's thread reads the cache.
        self._lock = threading.Lock()
        # Each constrained sequence's grammar state by its id, kept through preemptions (the wrap-up's
        # decision with it), dropped when the sequence finishes (``forget``).
        self._grammars: dict[int, GuidanceGrammar] = {}
        self._reasoning = ReasoningGate()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # cache misses (tests and logs)

    def warm_up(self) -> Future[Any]:
        """Build the grammar engine's view of the vocabulary, and the probe's, on the compile thread now
        (a server does it as it starts): building them holds the interpreter for a moment, which the
        first constrained request would otherwise cost every running stream."""
        def build() -> None:
            _ = self.backend.tokenizer
            self.compiler.prepare_probe()

        return self.compiler.run(build)

    # ------------------------------------------------------------ admission
    def validate(self, params: SamplingParams) -> None:
        """Compile the request's constraint (or find it compiled); ValueError naming what is invalid."""
        if params.structured_outputs is not None:
            self.template(params.structured_outputs)

    def submit(self, so: StructuredOutputsParams) -> Future[Any]:
        """A future of the constraint's template matcher (or of a ``Refused`` saying why it is refused):
        done at once when the constraint was seen before, else compiled on the compile thread. Requests
        with the same constraint share one compilation."""
        key = so.key()
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                return found
            self.num_compiled += 1

            def then(_: Any) -> None:
                if so.kind in WRAP_UP_KINDS:
                    _ = self.wrap_up_masks  # built here rather than inside a step

            future = self._templates[key] = self.compiler.submit(so, then)
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
        return future

    def template(self, so: StructuredOutputsParams) -> Any:
        """The constraint's template matcher, waiting for its compilation; ValueError if refused."""
        return self.accepted(self.submit(so).result())

    @staticmethod
    def accepted(compiled: Any) -> Any:
        """The template matcher a ``submit`` future gave; ValueError if it gave a refusal."""
        if isinstance(compiled, Refused):
            compiled.raise_()
        return compiled

    # ------------------------------------------------------------------ step
    def grammar_for(self, seq: ConstrainedSeq) -> GuidanceGrammar:
        grammar = self._grammars.get(seq.seq_id)
        if grammar is None:
            so = seq.params.structured_outputs
            assert so is not None
            grammar = self._grammars[seq.seq_id] = self.backend.new_grammar(self.template(so))
        return grammar

    def grammar_state(self, seq_id: int) -> GuidanceGrammar | None:
        """The sequence's grammar state, if it has started one (tests, and a stopped grammar's check)."""
        return self._grammars.get(seq_id)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the grammar states of finished sequences (called between masks, never during one)."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._grammars.pop(seq_id, None)
        self._reasoning.forget(seq_ids)

    def start_mask(self, seqs: Seq[ConstrainedSeq]) -> Future[GrammarMask] | None:
        """Begin filling the bitmask of this step's sampled sequences on a worker thread (the model's
        forward pass runs meanwhile); None when none of them is constrained."""
        if not any(needs_mask(s.params) for s in seqs):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-grammar")
        return self._pool.submit(self.fill_mask, list(seqs))

    def fill_mask(self, seqs: Seq[ConstrainedSeq]) -> GrammarMask:
        """The bitmask of the constrained ones among ``seqs`` (their row index in ``seqs``), each
        grammar first brought up to its sequence's output tokens; ``errors``: those whose grammar
        dead-ended (each may only end now)."""
        rows = [i for i, s in enumerate(seqs) if needs_mask(s.params)]
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        errors: dict[int, str] = {}
        live: list[tuple[GuidanceGrammar, int]] = []
        for k, i in enumerate(rows):
            seq = seqs[i]
            start = self._reasoning.end_of(seq) if gated(seq.params) else 0
            if start is None:  # still thinking: free, unless its budget is spent
                forced = self._reasoning.forced_token(seq)
                if forced is not None:
                    set_only(bitmask[k], [forced])
                continue
            if seq.params.structured_outputs is None:
                continue  # a budget only, and the thinking is over
            try:
                grammar = self.grammar_for(seq)
                grammar.advance(seq.output_token_ids[start:] if start else seq.output_token_ids)
            except Exception:  # never fail the batch over one sequence's grammar
                logger.exception("grammar of seq %d failed: it may only end now", seq.seq_id)
                grammar = None
            if grammar is None or grammar.failed:
                self._dead_end(seq, grammar, errors)
                set_only(bitmask[k], self.eos_token_ids)
            else:
                live.append((grammar, k))
                if grammar.wrap_up_from is None and self.should_wrap_up(seq, grammar):
                    grammar.wrap_up_from = grammar.num_tokens
        self.backend.fill_bitmask(live, bitmask)
        for grammar, k in live:
            if grammar.failed:  # found while computing the mask: no token extends the output
                self._dead_end(seqs[rows[k]], grammar, errors)
                set_only(bitmask[k], self.eos_token_ids)
        for grammar, k in live:
            if grammar.wrap_up_from is not None and not grammar.failed:
                seq = seqs[rows[k]]
                self.wrap_up_masks.narrow(bitmask[k], may_end=seq.num_output_tokens >= seq.params.min_tokens)
        return GrammarMask(rows, bitmask, errors)

    @staticmethod
    def _dead_end(seq: ConstrainedSeq, grammar: GuidanceGrammar | None, errors: dict[int, str]) -> None:
        """Record that ``seq`` ends with finish_reason "error": its constraint can no longer be satisfied."""
        if seq.seq_id not in errors:
            errors[seq.seq_id] = why = grammar.error if grammar is not None else "the grammar failed"
            logger.warning("seq %d: its output can no longer satisfy its constraint (%s): it ends with "
                           "finish_reason 'error'", seq.seq_id, why)

    def should_wrap_up(self, seq: ConstrainedSeq, grammar: GuidanceGrammar) -> bool:
        """A JSON document whose model repeats itself, or whose tokens left barely close it (see wrap_up.py)."""
        so = seq.params.structured_outputs
        if so is None or so.kind not in WRAP_UP_KINDS:
            return False
        if is_looping(seq.output_token_ids):
            return True
        left = tokens_left(seq.num_output_tokens, seq.params.max_tokens, seq.num_tokens, self.max_model_len)
        estimate = grammar.close_estimate
        if left > LOOKAHEAD or (estimate is not None and left > estimate + SLACK + RECHECK):
            return False
        grammar.close_estimate = self.wrap_up_masks.tokens_to_close(grammar.matcher, left)
        return grammar.close_estimate + SLACK >= left

    @property
    def wrap_up_masks(self) -> WrapUpMasks:
        if self._wrap_up_masks is None:
            self._wrap_up_masks = WrapUpMasks(self.backend.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._wrap_up_masks

    def close(self) -> None:
        self.compiler.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
