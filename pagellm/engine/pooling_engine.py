"""``PoolingEngine``: the pooling runner's engine (``--runner pooling``), apart from the generative one.

An encoder keeps no KV cache: each input is tokenized, queued (core/pooling_scheduler.py), run whole in
one step batched with other requests' inputs under the token budget, pooled and returned. A step whose
batch raises is run again one input at a time, so that only the input that fails alone fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagellm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from pagellm.core.pooling_scheduler import PoolingInput, PoolingScheduler
from pagellm.engine import startup
from pagellm.engine.phases import phase
from pagellm.model import loader
from pagellm.model.bert import BertModel
from pagellm.model.decoder_pooling import DecoderPoolingModel, load_decoder_pooler
from pagellm.model.encoders import ENCODER_REGISTRY, encoder_class_for, load_encoder
from pagellm.model.gguf_encoder import encoder_folder, gguf_encoder_architecture
from pagellm.model.hf_overrides import apply_hf_overrides
from pagellm.model.pooler import read_pooling_config
from pagellm.outputs import PoolingOutput, PoolingRequestOutput
from pagellm.worker.pooling_runner import POOLING_TASKS, PoolingRunner

logger = logging.getLogger(__name__)

# An input: text, token ids, {"prompt": text} / {"prompt_token_ids": ids}, or a (text, text) pair for a
# cross-encoder (its two segments, as the tokenizer joins them).
PoolingPrompt = str | list[int] | dict[str, Any] | tuple[str, str]


class InputTooLongError(ValueError):
    """An input longer than the model's limit, without truncate_prompt_tokens."""


class PoolingEngine:
    is_pooling = True

    def __init__(self, args: EngineArgs, task: str = "embed") -> None:
        if args.model is None:
            raise ValueError("--runner pooling needs a model folder (an encoder such as all-MiniLM-L6-v2)")
        if args.tensor_parallel_size != 1:
            raise ValueError("--runner pooling runs on one process: --tensor-parallel-size 1")
        self.args = args
        self.task = task  # embed or classify: what the model was converted to
        # A GGUF file of a bert / nomic-bert embedder becomes a Hugging Face folder (gguf_encoder.py).
        folder = (encoder_folder(Path(args.model).expanduser()) if gguf_encoder_architecture(args.model)
                  else loader.check_model_folder(args.model))
        self.model_path = folder
        assert not isinstance(args.hf_overrides, str)  # (EngineArgs parsed its JSON)
        self.model_config = config = apply_hf_overrides(loader.load_config(folder), args.hf_overrides)
        archs = list(getattr(config, "architectures", None) or [])
        # An encoder's own class, else one of the Llama family's decoders run whole (decoder_pooling.py).
        model_class = (encoder_class_for(archs) if any(a in ENCODER_REGISTRY for a in archs)
                       else DecoderPoolingModel)
        self.device = loader.resolve_device(args.device)
        self.dtype = loader.resolve_dtype(args.dtype, folder, self.device)
        # vLLM's default pooling: CLS for encoders, the last token for decoders (both normalised).
        self.pooling = read_pooling_config(folder, "lasttoken" if model_class is DecoderPoolingModel else "cls")
        self.max_model_len = self._max_model_len(model_class.max_positions(config), args.max_model_len)
        self.tokenizer = startup.load_tokenizer(args.tokenizer or str(folder))
        self.vocab_size = int(config.vocab_size)
        torch.manual_seed(args.seed)
        with phase("loading the weights"):
            model: BertModel | DecoderPoolingModel
            if model_class is DecoderPoolingModel:
                model = load_decoder_pooler(folder, config, self.dtype, self.device, self.tokenizer,
                                            task == "classify", args.load_format)
            else:
                model = load_encoder(folder, config, self.dtype, self.device, args.load_format, args.seed)
        pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
        self.runner = PoolingRunner(model, self.pooling, self.device, int(pad))
        budget = max(args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        self.scheduler = PoolingScheduler(budget, args.max_num_seqs)
        self._requests: dict[str, tuple[str, list[int]]] = {}  # id -> (task, prompt tokens)
        self.hidden_size = int(config.hidden_size)
        logger.info("pooling runner: %s (%s), %s pooling%s, max_model_len=%d", Path(args.model).name,
                    model_class.__name__, self.pooling.mode, " + normalize" if self.pooling.normalize else "",
                    self.max_model_len)

    def _max_model_len(self, positions: int, asked: int | None) -> int:
        """The positions the model holds, sentence-transformers' max_seq_length if smaller (as vLLM reads it)."""
        limit = positions if self.pooling.max_seq_length is None else min(positions, int(self.pooling.max_seq_length))
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len={asked} is larger than the model's limit of {limit} tokens: "
                             f"use --max-model-len {limit} or less")
        return asked or limit

    def shutdown(self) -> None:
        """Nothing to stop: the pooling engine runs in its caller's thread."""

    # ------------------------------------------------------------------ inputs
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model serves."""
        return ("embed",) if self.task == "embed" else ("embed", "classify", "score")

    def tokenize(self, prompt: PoolingPrompt, truncate_prompt_tokens: int | None = None,
                 ) -> tuple[list[int], list[int] | None]:
        """An input -> its token ids and token types; ValueError for an input too long or malformed."""
        limit = self._truncation(truncate_prompt_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        types: list[int] | None = None
        if isinstance(prompt, (str, tuple)):
            # As a batch of one: a pair's empty second text stays a segment (the tokenizer would drop it).
            pair = {"text_pair": [prompt[1]]} if isinstance(prompt, tuple) else {}
            first = prompt[0] if isinstance(prompt, tuple) else prompt
            enc = self.tokenizer([first], add_special_tokens=True, truncation=limit is not None,
                                 max_length=limit, **pair)
            ids = list(enc["input_ids"][0])
            types = list(enc["token_type_ids"][0]) if "token_type_ids" in enc else None
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
            if limit is not None:
                ids = ids[-limit:] if limit else []
        else:
            raise ValueError("an input must be a string, a list of token ids, a dict or a (text, text) pair, "
                             f"not {type(prompt).__name__}")
        if not ids:
            raise ValueError("an input must have at least one token")
        if len(ids) > self.max_model_len:
            raise InputTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input. Please reduce the length of the input, or pass "
                "truncate_prompt_tokens (-1: the model's limit) to truncate it.")
        return ids, types

    def _truncation(self, k: int | None) -> int | None:
        if k is None:
            return None
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise ValueError(f"truncate_prompt_tokens must be an integer >= -1, got {k!r}")
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={k} is larger than max_model_len={self.max_model_len}")
        return self.max_model_len if k == -1 else k

    def add_request(self, request_id: str, prompt: PoolingPrompt, task: str = "embed",
                    truncate_prompt_tokens: int | None = None) -> list[int]:
        """Tokenize and queue one input; returns its token ids."""
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        if task not in self.tasks():
            raise ValueError(f"this model does not {task}: it was loaded for {self.task} (--convert)")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already queued")
        ids, types = self.tokenize(prompt, truncate_prompt_tokens)
        self.enqueue(request_id, ids, types, task)
        return ids

    def enqueue(self, request_id: str, ids: list[int], types: list[int] | None, task: str) -> None:
        self._requests[request_id] = (task, ids)
        self.scheduler.add(PoolingInput(request_id, 0, ids, types))

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.scheduler.abort(ids)
        for rid in ids:
            self._requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_waiting()

    # ------------------------------------------------------------------ steps
    def step(self) -> list[tuple[str, PoolingRequestOutput | Exception]]:
        """One batch: per input, its output or the error it failed with alone."""
        batch = self.scheduler.schedule()
        by_task: dict[str, list[PoolingInput]] = {}
        for item in batch:
            by_task.setdefault(self._requests[item.request_id][0], []).append(item)
        results: list[tuple[str, PoolingRequestOutput | Exception]] = []
        for task, items in by_task.items():
            results.extend(self._run(items, task))
        for item in batch:
            self._requests.pop(item.request_id, None)
        return results

    def _run(self, items: list[PoolingInput], task: str) -> list[tuple[str, PoolingRequestOutput | Exception]]:
        try:
            rows = self.runner.run(items, task)
        except Exception as e:
            if len(items) == 1:
                logger.warning("pooling input %s failed: %s", items[0].request_id, e)
                return [(items[0].request_id, e)]
            logger.warning("a pooling batch of %d inputs failed (%s): running them one at a time", len(items), e)
            return [result for item in items for result in self._run([item], task)]
        return [(item.request_id, PoolingRequestOutput(item.request_id, PoolingOutput(row), item.token_ids))
                for item, row in zip(items, rows)]
