"""Packed bfloat16 linears give exactly what nn.Linear gives, and only replace where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagellm.model.packed_linear import PackedLinear, pack_linear_layers, packing_works

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not packing_works(torch.bfloat16, CPU), reason="no oneDNN bfloat16 on this CPU")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (7,), (3, 5)])
def test_packed_linear_equals_nn_linear(bias, lead):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*lead, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


@needs_packing
def test_pack_linear_layers_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False))).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model(x)
        assert pack_linear_layers(model, torch.bfloat16, CPU) == 2
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert torch.equal(model(x), before)


def test_float32_and_other_devices_keep_nn_linear():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linear_layers(model, torch.float32, CPU) == 0
    assert pack_linear_layers(model, torch.bfloat16, torch.device("meta")) == 0
    assert isinstance(model[0], nn.Linear)
