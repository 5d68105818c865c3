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
    # Rounded to nearest once from float32 sums: within half an ulp of the exact result, plus what
    # float32 additions lose (generous: 1e-6 of the sum of magnitudes).
    err = (got.double() - exact).abs()
    bound = 0.5 * _bf16_ulp(torch.maximum(exact.abs(), got.double().abs())) + 1e-6 * (
        x.double().abs() @ weight.double().abs().T)
    assert bool((err <= bound).all()), f"max error {err.max().item()} (bound there {bound.flatten()[err.argmax()]})"


@needs_linear
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 41, 100])  # one tile, tiles of unequal rows, many tiles
@pytest.mark.parametrize("out_features", [1, 16, 33, 50, 96])  # partial panels: first half, second half
@pytest.mark.parametrize("in_features", [1, 2, 63, 64])  # odd: the last pair is half zero
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_exact_products(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g) if bias else None
    _check(x, weight, b, native.linear_bf16(x, native.pack_linear_weight(weight), out_features, b))


@needs_linear
@pytest.mark.parametrize("rows,out_features", [(1, 33), (41, 1000), (13, 50)])
def test_float32_output_is_the_bfloat16_result_widened(rows, out_features):
    """The LM head's logits: the same values as the bfloat16 output followed by float()."""
    g = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g)
    packed = native.pack_linear_weight(weight)
    got = native.linear_bf16(x, packed, out_features, bias, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, native.linear_bf16(x, packed, out_features, bias).float())
    with pytest.raises(ValueError, match="out_dtype"):
        native.linear_bf16(x, packed, out_features, out_dtype=torch.float16)


@needs_linear
def test_no_inputs_gives_the_bias():
    weight = torch.empty(40, 0, dtype=torch.bfloat16)
    bias = torch.randn(40)
    got = native.linear_bf16(torch.empty(3, 0, dtype=torch.bfloat16), native.pack_linear_weight(weight), 40, bias)
    assert torch.equal(got, bias.to(torch.bfloat16).expand(3, 40))


@needs_linear
def test_packed_layout():
    """Word [p, j, c] holds (w[32p + c, 2j], w[32p + c, 2j + 1]) as low and high halves, zero outside."""
    weight = torch.randn(37, 5).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.int32
    bits = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    padded = torch.zeros(64, 6, dtype=torch.int64)
    padded[:37, :5] = bits
    want = (padded[:, 0::2] | padded[:, 1::2] << 16).view(2, 32, 3).transpose(1, 2)
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, want)


@needs_linear
@pytest.mark.parametrize("rows", [1, 13, 41])
@pytest.mark.parametrize("inter", [1, 16, 17, 300])  # partial panels: a lone column, one short of a panel
@pytest.mark.parametrize("in_features,bias", [(64, False), (63, True)])
def test_gated_output_is_silu_and_mul_of_the_linear(rows, inter, in_features, bias):
    """The MLP's fused activation: the same bits as the bfloat16 [gate | up] followed by silu_and_mul."""
    g = torch.Generator().manual_seed(rows * 100 + inter)
    weight = (torch.randn(2 * inter, in_features, generator=g) / 4).to(torch.bfloat16)
    x = (torch.randn(rows, in_features, generator=g) * 3).to(torch.bfloat16)
    b = torch.randn(2 * inter, generator=g) if bias else None
    # Row 0's first gates exactly past exp's clamps both ways, either side of silu's -88 cut, and zero.
    edges = torch.tensor([100.0, -100.0, -88.5, -87.5, 0.0])[:inter]
    weight[: len(edges)] = 0
    weight[range(len(edges)), range(len(edges))] = 1  # gate j = x[:, j]
    x[0, : len(edges)] = edges
    if b is not None:
        b[: len(edges)] = 0
    gate_up = native.linear_bf16(x, native.pack_linear_weight(weight), 2 * inter, b)
    got = native.linear_bf16(x, native.pack_linear_weight(weight, gated=True), 2 * inter, b, gated=True)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    assert torch.equal(gate_up[0, : len(edges)], edges.to(torch.bfloat16))
    assert torch.equal(got.view(torch.int16), native.silu_and_mul(gate_up).view(torch.int16))


@needs_linear
def test_gated_packed_layout():
    """Gated panel p holds gate rows 16p.. (word [p, j, 0, c]) and the up rows at the same offsets
    ([p, j, 1, c]): the words of a plain panel of those 32 rows."""
    inter = 20
    weight = torch.randn(2 * inter, 4).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight, gated=True)
    assert packed.shape == (2, 2, 2, 16)
    plain = native.pack_linear_weight(torch.cat([weight[:16], weight[inter:inter + 16]]))
    assert torch.equal(packed[0].flatten(), plain[0].flatten())  # a full panel: 16 gate rows, then their up rows
    tail = torch.zeros(32, 4, dtype=torch.bfloat16)
    tail[:4], tail[16:20] = weight[16:inter], weight[inter + 16:]
    assert torch.equal(packed[1].flatten(), native.pack_linear_weight(tail)[0].flatten())  # zero past the edges
    with pytest.raises(ValueError, match="even number of rows"):
        native.pack_linear_weight(weight[:7], gated=True)
    x = torch.randn(2, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="gated=True"):
        native.linear_bf16(x, native.pack_linear_weight(weight), 2 * inter, gated=True)  # packed plain
    with pytest.raises(ValueError, match="out_dtype"):
        native.linear_bf16(x, packed, 2 * inter, out_dtype=torch.float32, gated=True)


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
@pytest.mark.parametrize("rows,in_features", [(41, 512), (300, 4863)])  # 4,863: odd, rows in three chunks
def test_a_row_gets_the_same_bits_whatever_the_batch(threads, rows, in_features):
    """Decode batches change every step: a request's logits must not depend on who else is in it."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, in_features, generator=g).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native.linear_bf16(x, packed, 200)
        for i in (0, 10, 11, rows - 1):
            assert torch.equal(native.linear_bf16(x[i:i + 1], packed, 200), batch[i:i + 1])
        assert torch.equal(native.linear_bf16(x[5:rows - 3], packed, 200), batch[5:rows - 3])
    finally:
        torch.set_num_threads(before)


def test_not_used_on_amx_cpus(monkeypatch):
    """oneDNN's tile instructions win there, whatever the compiler knew of AMX."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    native._has_linear.cache_clear()
    try:
        assert not native.linear_supported()
        from pagellm.model.packed_linear import linear_kernel

        assert linear_kernel(torch.bfloat16, torch.device("cpu")) != "native"
    finally:
        native._has_linear.cache_clear()


@needs_linear
def test_empty_batch_and_bad_arguments():
    weight = torch.randn(8, 6).to(torch.bfloat16)
    packed = native.pack_linear_weight(weight)
    assert native.linear_bf16(torch.empty(0, 6, dtype=torch.bfloat16), packed, 8).shape == (0, 8)
    with pytest.raises(ValueError, match="2-D bfloat16 CPU tensor"):
        native.linear_bf16(torch.randn(2, 6), packed, 8)  # float32 input
    with pytest.raises(ValueError, match="2-D bfloat16 CPU tensor"):  # the input is named, not out_dtype
        native.linear_bf16(torch.randn(2, 6).half(), packed, 8, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous rows"):
        native.linear_bf16(torch.randn(6, 2).to(torch.bfloat16).T, packed, 8)  # a transposed view
    with pytest.raises(ValueError, match="not one of 8 x 10.*wrong number of columns"):
        native.linear_bf16(torch.randn(2, 10).to(torch.bfloat16), packed, 8)  # another weight's width
    with pytest.raises(ValueError, match="bias"):
        native.linear_bf16(torch.randn(2, 6).to(torch.bfloat16), packed, 8, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        native.linear_bf16(torch.randn(2, 6).to(torch.bfloat16), packed, 8, torch.zeros(7))
    with pytest.raises(ValueError, match="bfloat16 CPU weight"):
        native.pack_linear_weight(torch.randn(8, 6))


def test_without_native_kernels_the_kernel_says_so(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert not native.linear_supported()
        with pytest.raises(RuntimeError, match="check linear_supported"):
            native.pack_linear_weight(torch.randn(8, 6).to(torch.bfloat16))
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
