"""The batched LoRA op: each row gets its own adapter's x @ A^T @ B^T, base rows nothing, whether the step
runs as one padded bmm or as per-adapter segments."""

from __future__ import annotations

import pytest
import torch

from pagellm.lora import punica
from pagellm.lora.punica import LoRAStep, add_lora
from pagellm.lora.weights import LoRAWeights

KEY = (0, "qkv_proj")
WIDTHS = (8, 4, 4)  # q, k, v
MAX_RANK = 4


def adapters(ranks: list[int], parts: list[list[int]]):
    """Adapters of the given ranks, each adapting the given parts of a q/k/v projection of 12 inputs."""
    gen = torch.Generator().manual_seed(0)
    starts = [0, 8, 12]
    weights = []
    a_stack = torch.zeros(len(ranks), 12, 3 * MAX_RANK)
    b_stacks = [torch.zeros(len(ranks), MAX_RANK, w) for w in WIDTHS]
    for s, (r, ps) in enumerate(zip(ranks, parts)):
        a = torch.randn(12, r * len(ps), generator=gen)
        bs = [(starts[j], torch.randn(r, WIDTHS[j], generator=gen)) for j in ps]
        weights.append(LoRAWeights(f"a{s}", r, {KEY: (a, bs)}))
        for k, j in enumerate(ps):
            a_stack[s, :, j * MAX_RANK : j * MAX_RANK + r] = a[:, k * r : (k + 1) * r]
            b_stacks[j][s, :r] = bs[k][1]
    return weights, {KEY: (a_stack, b_stacks)}


def reference(x: torch.Tensor, w: LoRAWeights) -> torch.Tensor:
    a, bs = w.tensors[KEY]
    out = torch.zeros(x.shape[0], sum(WIDTHS))
    for k, (offset, b) in enumerate(bs):
        out[:, offset : offset + b.shape[1]] = x @ a[:, k * w.rank : (k + 1) * w.rank] @ b
    return out


DECODES = [2, -1, 0, 0, 1, 2, -1, 1, 0]


@pytest.mark.parametrize("padding", [0.0, 100.0])  # segments only; bmm wherever it applies
@pytest.mark.parametrize("prompts", [[], [1] * 20 + [-1] * 17 + [2] * 16])  # then runs of one adapter's rows
def test_each_row_gets_its_own_adapter(monkeypatch, padding, prompts):
    monkeypatch.setattr(punica, "BMM_PADDING", padding)
    weights, stacks = adapters([4, 2, 4], [[0, 1, 2], [1], [0, 2]])
    gen = torch.Generator().manual_seed(1)
    row_slots = torch.tensor(DECODES + prompts)
    x = torch.randn(len(row_slots), 12, generator=gen)
    base = torch.randn(len(row_slots), sum(WIDTHS), generator=gen)
    step = LoRAStep(row_slots, list(weights), stacks, kept_rows=torch.tensor([0, 4, 6]))
    got = add_lora(base.clone(), x, KEY, step)
    want = base.clone()
    for i, s in enumerate(row_slots.tolist()):
        if s >= 0:
            want[i] += reference(x[i : i + 1], weights[s])[0]
    torch.testing.assert_close(got, want)
    kept = add_lora(base[[0, 4, 6]].clone(), x[[0, 4, 6]], KEY, step)  # the last layer's rows
    torch.testing.assert_close(kept, want[[0, 4, 6]])
    assert (step.plan(len(row_slots)).gather is not None) == (padding > 1)
    assert len(step.plan(len(row_slots)).runs) == (2 if prompts else 0)
