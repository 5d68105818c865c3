"""The native bfloat16 linear kernel against float64 products, whatever the batch."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import native

needs_linear = pytest.mark.skipif(not native.linear_supported(), reason="no AVX512-BF16 kernel here (or AMX: oneDNN)")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bfloat16 at each magnitude of x."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-100))) - 7)


def _check(x: torch.Tensor, weight: torch.Tensor, bias, got: torch.Tensor) -> None:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    # Rounded once from float32 sums: within an ulp of the exact result (plus float32's own error).
    err = (got.double() - exact).abs()
    bound = _bf16_ulp(exact) + 1e-6 * (x.double().abs() @ weight.double().abs().T)
    assert bool((err <= bound).all()), f"max error {err.max().item()} (bound there {bound.flatten()[err.argmax()]})"


@needs_linear
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 41, 100])  # one tile, tiles of unequal rows, many tiles
@pytest.mark.parametrize("out_features", [1, 16, 33, 96])  # partial panels and partial vectors
@pytest.mark.parametrize("in_features", [1, 2, 63, 64])  # odd: the last pair is half zero
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_exact_products(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g) if bias else None
    _check(x, weight, b, native.linear_bf16(x, native.pack_linear_weight(weight), out_features, b))


@needs_linear
def test_large_inputs_in_several_chunks_and_strided_rows():
    # 4,864 inputs: the kernel takes about 1 MiB of them (108 rows) at a time, so 300 rows in three chunks.
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 4864, generator=g).to(torch.bfloat16)
    wide = torch.randn(300, 5000, generator=g).to(torch.bfloat16)
    x = wide[:, 7:7 + 4864]  # rows 5,000 apart
    _check(x, weight, None, native.linear_bf16(x, native.pack_linear_weight(weight), 70))


@needs_linear
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_gets_the_same_bits_whatever_the_batch(threads):
    """Decode batches change every step: a request's logits must not depend on who else is in it."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 512, generator=g).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight)
    x = torch.randn(41, 512, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native.linear_bf16(x, packed, 200)
        for i in (0, 10, 11, 40):
            assert torch.equal(native.linear_bf16(x[i:i + 1], packed, 200), batch[i:i + 1])
        assert torch.equal(native.linear_bf16(x[5:30], packed, 200), batch[5:30])
    finally:
        torch.set_num_threads(before)


@needs_linear
def test_empty_batch_and_bad_arguments():
    weight = torch.randn(8, 6).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight)
    assert native.linear_bf16(torch.empty(0, 6, dtype=torch.bfloat16), packed, 8).shape == (0, 8)
    with pytest.raises(ValueError, match="does not fit"):
        native.linear_bf16(torch.randn(2, 6), packed, 8)  # float32 input
    with pytest.raises(ValueError, match="does not fit"):
        native.linear_bf16(torch.randn(2, 10).to(torch.bfloat16), packed, 8)  # another weight's width
    with pytest.raises(ValueError, match="bias"):
        native.linear_bf16(torch.randn(2, 6).to(torch.bfloat16), packed, 8, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 CPU weight"):
        native.pack_linear_weight(torch.randn(8, 6))
