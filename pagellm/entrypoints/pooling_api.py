"""The offline pooling methods of ``LLM`` (vLLM's ``embed``, ``encode``, ``classify``, ``score``) over the
pooling engine (``runner="pooling"``)."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from pagellm.engine.pooling_engine import PoolingEngine, PoolingPrompt
from pagellm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

_POOLING_IDS = itertools.count()


def _as_inputs(prompts: Any) -> list[PoolingPrompt]:
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral)
    ):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be one prompt (a string, a list of token ids or a dict) or a list of them, "
                        f"not {type(prompts).__name__}")
    return list(prompts)


def _score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one query against every document, or two lists of the same length, pairwise."""
    one = _as_inputs(data_1)
    two = _as_inputs(data_2)
    if len(one) == 1:
        return [(one[0], d) for d in two]
    if len(one) != len(two):
        raise ValueError(f"score takes one query and many documents, or as many queries as documents; got "
                         f"{len(one)} and {len(two)}")
    return list(zip(one, two))


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class PoolingAPI:
    """Mixed into ``LLM``: its pooling methods."""

    llm_engine: Any

    def _pooling_engine(self, method: str, pooling_params: Any = None) -> PoolingEngine:
        if pooling_params is not None:
            raise ValueError(f"LLM.{method}: pooling_params is not supported yet; the folder's sentence-transformers "
                             "configuration decides pooling and normalisation (leave pooling_params unset)")
        engine = self.llm_engine
        if not isinstance(engine, PoolingEngine):
            raise ValueError(f"LLM.{method} needs a pooling model: this one generates text. Load an encoder "
                             "(e.g. all-MiniLM-L6-v2) with LLM(model, runner='pooling')")
        return engine

    def _pool(self, engine: PoolingEngine, prompts: list[PoolingPrompt], task: str,
              truncate_prompt_tokens: int | None, use_tqdm: bool | Callable[..., Any]) -> list[PoolingRequestOutput]:
        ids = [f"pool-{next(_POOLING_IDS)}" for _ in prompts]
        try:
            for rid, prompt in zip(ids, prompts):
                engine.add_request(rid, prompt, task, truncate_prompt_tokens)
        except Exception:
            engine.abort_request(ids)  # a bad input queues nothing of its batch
            raise
        done: dict[str, PoolingRequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                for rid, result in engine.step():
                    if isinstance(result, Exception):
                        raise result
                    done[rid] = result
                    bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def encode(self, prompts: Any, pooling_params: Any = None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable[..., Any] = True, pooling_task: str | None = None,
               ) -> list[PoolingRequestOutput]:
        """Each input's pooled output: its embedding (``pooling_task`` embed, the default of an embedding
        model) or its classifier's output (classify, the default of a cross-encoder)."""
        engine = self._pooling_engine("encode", pooling_params)
        task = pooling_task or ("embed" if engine.task == "embed" else "classify")
        return self._pool(engine, _as_inputs(prompts), task, truncate_prompt_tokens, use_tqdm)

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per input (``outputs.embedding``), pooled and normalised as the model's
        sentence-transformers configuration says."""
        engine = self._pooling_engine("embed", pooling_params)
        outs = self._pool(engine, _as_inputs(prompts), "embed", truncate_prompt_tokens, use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None,
                 ) -> list[ClassificationRequestOutput]:
        """Each input's class probabilities (``outputs.probs``: softmax, or sigmoid for one label)."""
        engine = self._pooling_engine("classify", pooling_params)
        outs = self._pool(engine, _as_inputs(prompts), "classify", truncate_prompt_tokens, use_tqdm)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: Any, data_2: Any, /, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True, pooling_params: Any = None,
              ) -> list[ScoringRequestOutput]:
        """Each (query, document) pair's score: a cross-encoder's output on the pair (as sentence-transformers'
        CrossEncoder.predict), or an embedding model's cosine similarity of the two embeddings."""
        engine = self._pooling_engine("score", pooling_params)
        pairs = _score_pairs(data_1, data_2)
        if engine.task == "classify":
            for q, d in pairs:
                if not isinstance(q, str) or not isinstance(d, str):
                    raise ValueError("a cross-encoder scores pairs of texts")
            outs = self._pool(engine, list(pairs), "score", truncate_prompt_tokens, use_tqdm)
            return [ScoringRequestOutput.from_base(o) for o in outs]
        texts = [q for q, _ in pairs] + [d for _, d in pairs]
        embs = self._pool(engine, texts, "embed", truncate_prompt_tokens, use_tqdm)
        n = len(pairs)
        return [ScoringRequestOutput(f"score-{next(_POOLING_IDS)}",
                                     ScoringOutput(_cosine(embs[i].outputs.data, embs[n + i].outputs.data)),
                                     embs[i].prompt_token_ids + embs[n + i].prompt_token_ids)
                for i in range(n)]
