"""Packed bfloat16 linears give what nn.Linear gives (oneDNN: the same bits; the native kernel: to
the last bit of rounding), and only replace where they apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagellm.kernels import native
from pagellm.model.packed_linear import PackedLinear, linear_kernel, pack_linear_layers, packing_works

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not packing_works(torch.bfloat16, CPU), reason="no oneDNN bfloat16 on this CPU")
needs_native = pytest.mark.skipif(not native.linear_supported(), reason="no native bfloat16 linear on this CPU")


def _assert_same_to_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one bfloat16 rounding step of the larger magnitude (sums added in another order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = torch.maximum(got.float().abs(), want.float().abs())
    assert bool(((got.float() - want.float()).abs() <= scale * 2.0**-7 + 1e-3).all())


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=needs_onednn),
                                    pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (7,), (3, 5)])
def test_packed_linear_equals_nn_linear(kernel, bias, lead):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*lead, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = PackedLinear(linear, kernel)(x), linear(x)
    if kernel == "onednn":
        assert torch.equal(got, want)
    else:
        _assert_same_to_rounding(got, want)


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=needs_onednn),
                                    pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_float32_output_is_the_layer_output_widened(kernel, lead):
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(64, 80, bias=True).to(torch.bfloat16), kernel)
    x = torch.randn(*lead, 64).to(torch.bfloat16)
    with torch.inference_mode():
        logits = layer(x, out_dtype=torch.float32)
        assert logits.dtype == torch.float32 and logits.shape == (*lead, 80)
        assert torch.equal(logits, layer(x).float())


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=needs_onednn),
                                    pytest.param("native", marks=needs_native)])
def test_inputs_of_the_wrong_width_are_refused(kernel):
    layer = PackedLinear(nn.Linear(64, 80).to(torch.bfloat16), kernel)
    with pytest.raises(ValueError, match="input of 63 features to a linear layer of 64"):
        layer(torch.randn(2, 3, 63).to(torch.bfloat16))


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown linear kernel"):
        PackedLinear(nn.Linear(4, 4).to(torch.bfloat16), "fast")


@pytest.mark.skipif(linear_kernel(torch.bfloat16, CPU) is None, reason="no packed kernel on this CPU")
def test_pack_linear_layers_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False))).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model(x)
        assert pack_linear_layers(model, torch.bfloat16, CPU) == 2
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        if linear_kernel(torch.bfloat16, CPU) == "onednn":
            assert torch.equal(model(x), before)
        else:
            _assert_same_to_rounding(model(x), before)
    # The native kernel where the CPU has it (AVX512-BF16 without AMX), else oneDNN's.
    assert {m.kernel for m in model.modules() if isinstance(m, PackedLinear)} == {linear_kernel(torch.bfloat16, CPU)}
    assert linear_kernel(torch.bfloat16, CPU) == ("native" if native.linear_supported() else "onednn")


def test_float32_and_other_devices_keep_nn_linear():
    model = nn.Sequential(nn.Linear(8, 8))
    assert linear_kernel(torch.float32, CPU) is None
    assert pack_linear_layers(model, torch.float32, CPU) == 0
    assert pack_linear_layers(model, torch.bfloat16, torch.device("meta")) == 0
    assert isinstance(model[0], nn.Linear)


def test_without_native_kernels_linears_use_onednn(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert linear_kernel(torch.bfloat16, CPU) == ("onednn" if packing_works(torch.bfloat16, CPU) else None)
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


@needs_native
def test_native_linear_takes_a_non_contiguous_input():
    torch.manual_seed(0)
    linear = nn.Linear(6, 8).to(torch.bfloat16)
    x = torch.randn(6, 4).to(torch.bfloat16).T  # (4, 6) with its columns 4 elements apart
    with torch.inference_mode():
        _assert_same_to_rounding(PackedLinear(linear, "native")(x), linear(x))


@needs_native
def test_the_mlp_gate_up_projection_is_packed_gated_with_the_same_output():
    """The native kernel applies silu(gate) * up as it stores: the MLP gives the same bits as the
    plain packed projection followed by the separate activation."""
    from pagellm.model.layers import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = mlp(x)
        plain = PackedLinear(mlp.gate_up_proj, "native")
        assert pack_linear_layers(mlp, torch.bfloat16, CPU) == 2
        assert mlp.gate_up_proj.gated and not mlp.down_proj.gated
        assert mlp.gate_up_proj(x).shape == (9, 40)
        separate = mlp.down_proj(native.silu_and_mul(plain(x)))
        assert torch.equal(mlp(x), separate)
        _assert_same_to_rounding(mlp(x), before)
    with pytest.raises(ValueError, match="only the native kernel"):
        PackedLinear(nn.Linear(4, 8).to(torch.bfloat16), "onednn", gated=True)
