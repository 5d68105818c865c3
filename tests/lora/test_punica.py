"""The batched LoRA op: each row gets its own adapter's x @ A^T @ B^T, base rows nothing, whether the step
runs as one padded bmm or as per-adapter segments."""

from __future__ import annotations

import pytest
import torch

from pagellm.lora import punica
from pagellm.lora.punica import LoRAStep, add_lora
from pagellm.lora.weights import LoRAWeights

KEY = (0, "qkv_proj")


def adapters(num: int, fan_in: int, fan_out: int, ranks: list[int], max_rank: int):
    gen = torch.Generator().manual_seed(0)
    weights = [LoRAWeights(f"a{i}", r, {KEY: (torch.randn(fan_in, r, generator=gen),
                                              torch.randn(r, fan_out, generator=gen))}) for i, r in enumerate(ranks)]
    a_stack = torch.zeros(num, fan_in, max_rank)
    b_stack = torch.zeros(num, max_rank, fan_out)
    for s, w in enumerate(weights):
        a, b = w.tensors[KEY]
        a_stack[s, :, : a.shape[1]] = a
        b_stack[s, : b.shape[0]] = b
    return weights, {KEY: (a_stack, b_stack)}


@pytest.mark.parametrize("padding", [0.0, 100.0])  # segments only; bmm wherever it applies
def test_each_row_gets_its_own_adapter(monkeypatch, padding):
    monkeypatch.setattr(punica, "BMM_PADDING", padding)
    weights, stacks = adapters(3, 12, 10, [4, 2, 4], 4)
    gen = torch.Generator().manual_seed(1)
    row_slots = torch.tensor([2, -1, 0, 0, 1, 2, -1, 1, 0])
    x = torch.randn(len(row_slots), 12, generator=gen)
    base = torch.randn(len(row_slots), 10, generator=gen)
    step = LoRAStep(row_slots, list(weights), stacks, kept_rows=torch.tensor([0, 4, 6]))
    got = add_lora(base.clone(), x, KEY, step)
    want = base.clone()
    for i, s in enumerate(row_slots.tolist()):
        if s >= 0:
            a, b = weights[s].tensors[KEY]
            want[i] += x[i] @ a @ b
    torch.testing.assert_close(got, want)
    kept = add_lora(base[[0, 4, 6]].clone(), x[[0, 4, 6]], KEY, step)  # the last layer's rows
    torch.testing.assert_close(kept, want[[0, 4, 6]])
    assert (step.plan(9).gather is not None) == (padding > 1)
