"""Call the quantized linear kernels (``csrc/quant_linear.c``, which documents GGUF's block formats)
and the quantized decode step (``csrc/decode_layer.c``); declared and loaded with the others by
``native.py``. Weights are named by ggml's type ids."""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.native import DTYPE_CODES, DecodeStep, _lib, _threads_for, load


class QuantMatrix(ctypes.Structure):
    """A quantized linear weight for ``decode_layers_quantized`` (``pagellm_quant_matrix``): up to three
    row segments, each its blocks, rows and ggml type."""

    _fields_ = [("data", ctypes.c_void_p * 3), ("rows", ctypes.c_int64 * 3), ("type", ctypes.c_int32 * 3),
                ("count", ctypes.c_int32)]


class DecodeQuantLayer(ctypes.Structure):
    """One decoder layer for ``decode_layers_quantized`` (``pagellm_decode_quant_layer``): RMSNorm
    weights in the step's dtype, the four quantized linears, their float32 biases or None, the pools."""

    _fields_ = ([("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]
                + [(name, QuantMatrix) for name in ("qkv", "o", "gate_up", "down")]
                + [(name, ctypes.c_void_p) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "k_pool",
                                                         "v_pool")])


def decode_layers_quantized(layers: ctypes.Array, step: DecodeStep, x: torch.Tensor, residual: torch.Tensor,
                            gate_up: torch.Tensor, int8_activations: bool) -> None:
    """``decode_layers`` for quantized linears, in ``x``'s dtype (float32 or bfloat16); ``gate_up`` is
    the work buffer of the MLP's (rows, 2 * inter) projection; ``int8_activations``: the linears'
    inputs quantized to 8 bits (``quant_linear(..., int8_activations=True)``)."""
    status = _lib().pagellm_decode_layers_quantized(layers, len(layers), ctypes.byref(step), x.data_ptr(),
                                                    residual.data_ptr(), gate_up.data_ptr(), DTYPE_CODES[x.dtype],
                                                    int(int8_activations), torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"native decode step: no memory for {step.rows} rows")
    assert status == 0, status


def quant_row_bytes(ggml_type: int, k: int) -> int:
    """Bytes per row of a ``k``-column weight of this ggml type; 0 where the kernels do not read the
    type (or ``k`` is not whole blocks, or there are no kernels)."""
    lib = load()
    return 0 if lib is None else int(lib.pagellm_quant_row_bytes(ggml_type, k))


def _check_quantized(weight: torch.Tensor, ggml_type: int, k: int) -> None:
    row_bytes = quant_row_bytes(ggml_type, k)
    if (row_bytes == 0 or weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes
            or not weight.is_contiguous() or weight.device.type != "cpu"):
        raise ValueError(f"quantized weight must be a contiguous CPU uint8 tensor of rows of {row_bytes} bytes "
                         f"(ggml type {ggml_type}, {k} columns), got {weight.dtype} {tuple(weight.shape)}")


def quant_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, int8_activations: bool = False, panels: bool = False
                 ) -> torch.Tensor:
    """x (m, k) float32 @ W.T (+ bias) for the quantized ``weight`` (n rows of blocks): (m, n) float32,
    written into ``out`` when given (a float32 (m, n) view whose rows are contiguous, such as a column
    slice of a wider output). With ``int8_activations`` each block of 32 of x is first quantized to
    int8 with its own scale (llama.cpp's Q8_0) and the products are integer dot products
    (``csrc/quant_linear_int8.c``): faster, with the error of that rounding. ``panels``: float inputs
    through ``pagellm_quant_linear_panel`` (``quant_linear_checked``)."""
    m, k = x.shape
    _check_quantized(weight, ggml_type, k)
    n = weight.shape[0]
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be a float32 ({m}, {n}) tensor with contiguous rows")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor of {n}")
    quant_linear_checked(x, weight, ggml_type, bias, out, int8_activations, panels)
    return out


def quant_linear_checked(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                         out: torch.Tensor, int8_activations: bool = False, panels: bool = False) -> None:
    """``quant_linear`` on arguments already checked (float32 x with contiguous rows, a weight
    ``_check_quantized`` accepted, out as there): a model's every decode step calls it, and the
    checks cost as much as the kernel on a small layer. ``panels`` (float inputs): the weight is
    dequantized a panel of rows at a time and every row multiplied there (any number of rows at a
    matmul's speed, each row's result independent of the others)."""
    m, k = x.shape
    if m:
        f32 = DTYPE_CODES[torch.float32]
        lib = _lib()
        kernel = (lib.pagellm_quant_linear_int8 if int8_activations
                  else lib.pagellm_quant_linear_panel if panels else lib.pagellm_quant_linear)
        status = kernel(
            x.data_ptr(), x.stride(0), f32, m, k, weight.data_ptr(), ggml_type, weight.shape[0],
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), f32,
            _threads_for(weight.numel() * m))
        if status != 0:
            raise MemoryError("quantized linear kernel could not allocate its working memory")


def check_quantized(weight: torch.Tensor, ggml_type: int, k: int) -> None:
    """ValueError unless ``weight`` is rows of blocks of this type and ``k`` columns the kernels read."""
    _check_quantized(weight, ggml_type, k)


def dequantize(weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """The quantized ``weight`` (n rows of blocks of ``k`` columns) as an (n, k) float32 tensor."""
    _check_quantized(weight, ggml_type, k)
    out = torch.empty(weight.shape[0], k, dtype=torch.float32)
    _lib().pagellm_dequantize(weight.data_ptr(), ggml_type, weight.shape[0], k, out.data_ptr(),
                              _threads_for(out.numel()))
    return out
