"""Linear layers whose weights stay in GGUF's quantized block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K), run by the native kernels (``kernels/csrc/quant_blocks.h`` documents the formats).

How they multiply: with int8 inputs, each input row is rounded to int8 per block of 32 and the
products are integer dot products (``quant_linear_int8.c``), as llama.cpp and vLLM's GGUF kernels do:
the kernel unpacks each weight block once per call whatever the number of rows, and gives each row
the same result whatever else is in the batch. With float inputs the weights widen to float32 instead
(``quant_linear.c``): closer to the dequantized model, slower.

The mode (``PAGELLM_QUANT_ACTIVATIONS``) is ``decode`` by default: generated tokens' rows take int8
inputs and prompt tokens' rows float ones, so that a prompt's first token is the dequantized model's
(rounding a small model's prompt to int8 changes some answers, as it does in llama.cpp). ``int8``
takes int8 inputs everywhere, ``float`` nowhere (the tests against transformers set it). The LM head
follows the same rule (``forward``'s ``decode_step``).

Float rows under ``--batch-invariant`` (on by default) go through the panel kernel: the weight is
dequantized a few rows at a time into a buffer the size of a core's cache and every row multiplied
there, each row's result independent of the others, so a prompt token's result does not depend on
its chunk, and the few rows left after a prefix hit cost their own products, not the whole weight's
dequantization. Without it, calls of up to ``DIRECT_MAX_ROWS`` rows read the blocks directly and
larger ones dequantize the weight once per call for PyTorch's matmul.

Where they come from:

- a GGUF file's quantized tensors, as stored (``--quantization gguf``, the default for a GGUF file
  where the kernels run; ``--quantization none`` dequantizes them into ``--dtype`` at load instead);
- a 16/32-bit checkpoint quantized at load: ``--quantization int8`` (per output channel, symmetric:
  one scale per row, kept as Q8_0 blocks that all carry their row's scale) or ``--quantization q4_0``
  (llama.cpp's Q4_0, a scale per 32 weights, by ``gguf``'s quantizer).

A fused projection (q/k/v, gate/up) is a stack of row segments, each in its own type, as the file
stores its parts (a Q4_K_M file keeps v in Q6_K beside q and k in Q4_K).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import quant
from pagellm.kernels.cpu_features import cpu_flags
from pagellm.model.row_padded_linear import padded_rows

logger = logging.getLogger(__name__)

# ggml's type ids of the formats the kernels read.
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}
# Prompt rows with float inputs under --no-batch-invariant: up to this many, the kernels read the blocks
# directly; above, one dequantization per call and a BLAS matmul are faster. (The integer kernel
# unpacks each block once for all rows: int8 inputs always read the blocks directly.)
DIRECT_MAX_ROWS = 16
ACTIVATIONS_ENV = "PAGELLM_QUANT_ACTIVATIONS"
ACTIVATION_MODES = ("decode", "int8", "float")
DEFAULT_ACTIVATIONS = "decode"
# Which rows of the current step's calls are prompt tokens: a bool mask per row count the step's calls
# have (every row, then the last layer's kept rows), () where none is; None outside a step (and in
# blocks that regroup rows, as MoE experts do). Set by the model's forward and the runner's LM head
# call (``step_prompt_rows``).
_PROMPT_ROWS: ContextVar[tuple[torch.Tensor, ...] | None] = ContextVar("pagellm_prompt_rows", default=None)


@contextmanager
def step_prompt_rows(masks: tuple[torch.Tensor, ...] | None) -> Iterator[None]:
    """Within it, quantized layers take a call's prompt rows from the mask of its row count."""
    token = _PROMPT_ROWS.set(masks)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def activation_mode() -> str:
    """Where the quantized layers round their inputs to int8 (``PAGELLM_QUANT_ACTIVATIONS``)."""
    mode = os.environ.get(ACTIVATIONS_ENV, DEFAULT_ACTIVATIONS).strip().lower() or DEFAULT_ACTIVATIONS
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"{ACTIVATIONS_ENV}={mode!r} is not one of {', '.join(ACTIVATION_MODES)}: decode rounds "
                         "the inputs of quantized linear layers to int8 in decode steps, int8 everywhere, "
                         "float nowhere (the dequantized weights' products, slower)")
    return mode


@dataclass
class QuantizedWeight:
    """A (rows, cols) weight as rows of ggml blocks: ``data`` is (rows, bytes per row) uint8."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 (rows, cols)."""
        return quant.dequantize(self.data, self.ggml_type, self.shape[1])

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.ggml_type]


def kernels_read(ggml_type: int, cols: int) -> bool:
    """Whether the native kernels read weights of this type and width (and are loaded)."""
    return quant.quant_row_bytes(ggml_type, cols) > 0


class QuantLinear(nn.Module):
    """y = x @ W.T + b for W stacked from quantized row segments (fused projections: one per part)."""

    bias: torch.Tensor | None

    def __init__(self, segments: list[QuantizedWeight], bias: torch.Tensor | None, inputs: str | None = None,
                 batch_invariant: bool = True) -> None:
        """``inputs``: one of ``ACTIVATION_MODES`` (None: ``PAGELLM_QUANT_ACTIVATIONS``'s);
        ``batch_invariant``: as ``--batch-invariant`` (``_float_rows``)."""
        super().__init__()
        cols = {s.shape[1] for s in segments}
        if len(cols) != 1:
            raise ValueError(f"segments of one linear layer must share their width, got {sorted(cols)}")
        self.in_features = cols.pop()
        self.out_features = sum(s.shape[0] for s in segments)
        self.inputs = activation_mode() if inputs is None else inputs
        if self.inputs not in ACTIVATION_MODES:
            raise ValueError(f"inputs must be one of {', '.join(ACTIVATION_MODES)}, got {self.inputs!r}")
        # This layer's own forward (prompt tokens, mixed steps, models without the one-call decoder).
        self.int8_activations = self.inputs == "int8"
        self.batch_invariant = batch_invariant
        self._multiply_16bit = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
        for s in segments:
            quant.check_quantized(s.data, s.ggml_type, self.in_features)
        self.segments = merge_segments(segments)
        self.bounds = np.cumsum([0] + [s.shape[0] for s in self.segments]).tolist()
        # Added to the float32 sums by the kernel.
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        # Each segment with its slice of the bias, for the kernel calls of every decode step.
        self._calls = [(s.data, s.ggml_type, None if self.bias is None else self.bias[begin:end], begin, end)
                       for s, begin, end in zip(self.segments, self.bounds, self.bounds[1:])]

    @property
    def weight_bytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 (out_features, in_features)."""
        parts = [s.dequantize() for s in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, decode_step: bool = False
                ) -> torch.Tensor:
        """x @ W.T + b in ``x``'s dtype, or ``out_dtype`` (float32 for logits). ``decode_step``: the rows
        are generated tokens, where no step says which rows are prompt tokens (``step_prompt_rows``).
        The ``decode`` mode multiplies generated tokens' rows with int8 inputs and prompt tokens' with
        float ones, whatever else shares the step."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of {x.shape[-1]} features to a linear layer of {self.in_features}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        # Generated tokens: int8 inputs unless the mode is float, on the kernels' direct reads (a row's
        # result is the same in every step). Prompt tokens: int8 inputs in the int8 mode, else float.
        prompt = self._prompt_mask(rows.shape[0], decode_step)
        if prompt is None:
            out = self._direct(rows, int8=self.inputs != "float")
        elif bool(prompt.all()):
            out = self._float_rows(rows)
        else:
            out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
            generated = ~prompt
            out[generated] = self._direct(rows[generated], int8=self.inputs != "float")
            out[prompt] = self._float_rows(rows[prompt])
        dtype = out_dtype or x.dtype
        return (out if out.dtype == dtype else out.to(dtype)).view(*lead, self.out_features)

    def _prompt_mask(self, m: int, decode_step: bool) -> torch.Tensor | None:
        """Which of a call's ``m`` rows take the prompt's inputs (None: none of them)."""
        if self.inputs == "int8":
            return None
        masks = _PROMPT_ROWS.get()
        if masks is None:  # no step's rows: decode_step says which
            return None if decode_step else torch.ones(m, dtype=torch.bool)
        return next((mask for mask in masks if mask.shape[0] == m), None)

    def _direct(self, rows: torch.Tensor, int8: bool, panels: bool = False) -> torch.Tensor:
        """The kernels on the blocks themselves, float32 out (``panels``: quant.quant_linear_checked's)."""
        if rows.dtype != torch.float32 or rows.stride(1) != 1:
            rows = rows.float().contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if len(self._calls) == 1:
            data, ggml_type, bias, _, _ = self._calls[0]
            quant.quant_linear_checked(rows, data, ggml_type, bias, out, int8, panels)
        else:
            for data, ggml_type, bias, begin, end in self._calls:
                quant.quant_linear_checked(rows, data, ggml_type, bias, out[:, begin:end], int8, panels)
        return out

    def _float_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Float inputs. Batch-invariant: the panel kernel, whose rows do not depend on one another
        (a prompt token's result does not depend on how many tokens share its chunk, and a few rows
        after a prefix hit do not pay for the whole weight's dequantization); a 16-bit model where the
        CPU multiplies 16-bit floats takes the dequantized weight's matmul in its dtype on at least
        ``MIN_MATMUL_ROWS`` rows (row_padded_linear.py) instead. Otherwise the kernels read the blocks
        directly up to ``DIRECT_MAX_ROWS`` rows, and larger calls dequantize the weight for a matmul."""
        m = rows.shape[0]
        sixteen_bit = rows.dtype != torch.float32 and self._multiply_16bit
        if self.batch_invariant and not sixteen_bit:
            return self._direct(rows, int8=False, panels=True)
        if not self.batch_invariant and m <= DIRECT_MAX_ROWS:
            return self._direct(rows, int8=False)
        if self.batch_invariant:
            rows = padded_rows(rows)
        weight = self.dequantized()
        if sixteen_bit:
            # a 16-bit model multiplies in its dtype, as it would unquantized, where the CPU computes it
            out = F.linear(rows, weight.to(rows.dtype), None if self.bias is None else self.bias.to(rows.dtype))
        else:  # (elsewhere PyTorch emulates 16-bit products, many times slower than float32's)
            out = F.linear(rows.float(), weight, self.bias)
        return out[:m]

    def extra_repr(self) -> str:
        types = "+".join(s.type_name for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}, inputs={self.inputs}"


def merge_segments(segments: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Neighbouring segments of one type as one (rows of blocks stack): one kernel call for q, k and
    v where a file stores them alike."""
    merged = [segments[0]]
    for s in segments[1:]:
        last = merged[-1]
        if s.ggml_type == last.ggml_type:
            merged[-1] = QuantizedWeight(torch.cat([last.data, s.data]), s.ggml_type,
                                         (last.shape[0] + s.shape[0], s.shape[1]))
        else:
            merged.append(s)
    return merged


def quantize_int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row, stored as Q8_0 blocks that all hold their row's
    scale (rounded to float16 first, so that the stored scale is the one the integers were made with)."""
    rows, cols = weight.shape
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.float16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    blocks = cols // 32
    data = torch.empty(rows, blocks, 34, dtype=torch.uint8)
    data[:, :, :2] = scale.view(torch.uint8).view(rows, 1, 2)
    data[:, :, 2:] = q.view(rows, blocks, 32).view(torch.uint8)
    return QuantizedWeight(data.view(rows, blocks * 34), GGML_TYPES["Q8_0"], (rows, cols))


def quantize_q4_0(weight: torch.Tensor) -> QuantizedWeight:
    """llama.cpp's Q4_0 of the weight (``gguf``'s reference quantizer)."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q4_0)
    rows, cols = weight.shape
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(raw)), GGML_TYPES["Q4_0"], (rows, cols))


QUANTIZERS = {"int8": quantize_int8_per_channel, "q4_0": quantize_q4_0}


def quantizable(method: str, linear: nn.Module) -> bool:
    """Whether ``method`` applies to this layer: an nn.Linear whose width is whole blocks of 32."""
    return isinstance(linear, nn.Linear) and linear.in_features % 32 == 0 and method in QUANTIZERS


def quantize_linear_layers(model: nn.Module, method: str, batch_invariant: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` (weights loaded) whose width is whole blocks by a
    ``QuantLinear`` quantized with ``method`` (int8 or q4_0); returns how many."""
    quantize = QUANTIZERS[method]
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if quantizable(method, child):
                assert isinstance(child, nn.Linear)
                module.add_module(name, QuantLinear([quantize(child.weight)], child.bias,
                                                     batch_invariant=batch_invariant))
                count += 1
    return count


def install_quantized(model: nn.Module, parts: dict[str, list[tuple[int, QuantizedWeight]]],
                      batch_invariant: bool = True) -> int:
    """Replace the ``nn.Linear`` layers whose weights a GGUF file held quantized (``parts``: parameter
    name -> (first row, weight) pieces covering its rows) by ``QuantLinear`` layers; returns how many."""
    count = 0
    for name, pieces in parts.items():
        module_name, _, leaf = name.rpartition(".")
        if leaf != "weight":
            raise ValueError(f"quantized tensor {name!r} is not a linear layer's weight")
        owner_name, _, child_name = module_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        linear = getattr(owner, child_name)
        pieces = sorted(pieces, key=lambda piece: piece[0])
        if not isinstance(linear, nn.Linear) or sum(p.shape[0] for _, p in pieces) != linear.out_features:
            raise ValueError(f"quantized pieces of {name!r} do not make up its {type(linear).__name__}")
        owner.add_module(child_name, QuantLinear([p for _, p in pieces], linear.bias, batch_invariant=batch_invariant))
        count += 1
    return count
