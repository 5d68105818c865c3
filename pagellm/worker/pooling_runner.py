"""The pooling runner: a batch of whole encoder inputs -> one padded forward pass -> per input, the pooled
and normalised embedding or the classifier's scores, as plain lists of floats."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagellm.core.pooling_scheduler import PoolingInput
from pagellm.model.bert import BertModel
from pagellm.model.bert_packed import length_groups
from pagellm.model.decoder_pooling import DecoderPoolingModel
from pagellm.model.pooler import PoolingConfig, normalize, pool

# What a step computes for its inputs: embeddings, or the classifier's outputs (classify: probabilities,
# score: the cross-encoder's activation, as sentence-transformers' CrossEncoder.predict applies it).
POOLING_TASKS = ("embed", "classify", "score")
# A step of at most this many tokens runs on one thread: its matrices are too small for a second thread to
# gain what synchronising the threads at every operation costs (on a busy machine, many times the work).
SMALL_STEP_TOKENS = 128


def score_activation(config: object) -> str:
    """The cross-encoder's activation: config.json's ``sentence_transformers.activation_fn`` where set,
    else sigmoid for one label and none for several (sentence-transformers' CrossEncoder, and vLLM)."""
    st = getattr(config, "sentence_transformers", None) or {}
    name = str(st.get("activation_fn", "")) if isinstance(st, dict) else ""
    if name:
        short = name.rsplit(".", 1)[-1].lower()
        if short in ("sigmoid", "identity", "softmax", "tanh"):
            return short
        raise ValueError(f"the cross-encoder's activation_fn {name!r} is not supported")
    return "sigmoid" if int(getattr(config, "num_labels", 1)) == 1 else "identity"


def _activate(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "softmax":
        return torch.softmax(x, dim=-1)
    if name == "tanh":
        return torch.tanh(x)
    return x


class PoolingRunner:
    def __init__(self, model: BertModel | DecoderPoolingModel, pooling: PoolingConfig, device: torch.device,
                 pad_token_id: int = 0) -> None:
        self.model = model
        self.pooling = pooling
        self.device = device
        self.pad_token_id = pad_token_id
        self.score_activation = score_activation(model.config) if model.is_classifier else "identity"

    def tensors(self, batch: Sequence[PoolingInput]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch padded to its longest input: ids, token types, attention mask."""
        length = max(max(item.num_tokens for item in batch), 1)
        ids = torch.full((len(batch), length), self.pad_token_id, dtype=torch.long)
        types = torch.zeros((len(batch), length), dtype=torch.long)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for row, item in enumerate(batch):
            n = item.num_tokens
            ids[row, :n] = torch.tensor(item.token_ids, dtype=torch.long)
            if item.token_type_ids is not None:
                types[row, :n] = torch.tensor(item.token_type_ids, dtype=torch.long)
            mask[row, :n] = 1
        return ids.to(self.device), types.to(self.device), mask.to(self.device)

    def run(self, batch: Sequence[PoolingInput], task: str) -> list[list[float]]:
        """Per input of ``batch``, its ``task``'s output: one forward pass where the model takes inputs of
        any lengths at once (``packs_inputs``: BERT's grouped rows), else one per group of like lengths
        (sorted by length, as sentence-transformers sorts its batches); a small step on one thread."""
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        threads = torch.get_num_threads()
        if threads > 1 and sum(item.num_tokens for item in batch) <= SMALL_STEP_TOKENS:
            torch.set_num_threads(1)
            try:
                return self._run_groups(batch, task)
            finally:
                torch.set_num_threads(threads)
        return self._run_groups(batch, task)

    def _run_groups(self, batch: Sequence[PoolingInput], task: str) -> list[list[float]]:
        rows: list[list[float]] = [[] for _ in batch]
        whole = getattr(self.model, "packs_inputs", False)
        for group in [list(range(len(batch)))] if whole else length_groups([item.num_tokens for item in batch]):
            for i, row in zip(group, self._run([batch[i] for i in group], task)):
                rows[i] = row
        return rows

    @torch.inference_mode()
    def _run(self, batch: Sequence[PoolingInput], task: str) -> list[list[float]]:
        ids, types, mask = self.tensors(batch)
        hidden = self.model(ids, types, mask)
        if task == "embed":
            out = pool(hidden, mask, self.pooling.mode)
            if self.pooling.normalize:
                out = normalize(out)
        else:
            logits = self.model.classify(hidden, mask).float()
            if task == "classify":
                out = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
            else:
                out = _activate(logits, self.score_activation)
        rows = out.float().cpu().tolist()
        bad = [i for i, row in enumerate(rows) if not all(math.isfinite(v) for v in row)]
        if bad:
            raise FloatingPointError(f"the model's output is not finite for input {bad[0]}")
        return rows
