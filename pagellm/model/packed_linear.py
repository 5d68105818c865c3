"""bfloat16 linear layers on CPU with their weights packed once for a faster kernel.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on
every call; at decode batch sizes that reorder costs as much as the multiply itself. Each weight is
therefore packed once after loading, for one of two kernels:

- ``"native"``: pagellm's own (``pagellm/kernels``, the AVX512-BF16 dot products), on CPUs that have
  them and no AMX. At decode's few to few dozen rows it runs 1.0-2.2x oneDNN's rate (the same at
  prefill's thousands); sums in float32 as oneDNN, in another order, so the last bit may differ.
- ``"onednn"``: oneDNN's packed layout (the ops PyTorch's own compiler uses when it freezes a CPU
  model), 1.2-3x ``F.linear`` with bit-identical results; everywhere else oneDNN has bfloat16.

Other devices and dtypes keep ``nn.Linear``. With the native kernel, a projection whose output is
``[gate | up]`` (a module's ``gated_projection``) is packed to return ``silu(gate) * up`` directly:
the same bits as the separate activation, without writing both halves out and reading them back.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import native

logger = logging.getLogger(__name__)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (already loaded) whose weight is kept packed for ``kernel``. ``gated`` (native
    kernel only): the layer's output is ``[gate | up]`` and the module returns ``silu(gate) * up``,
    ``out_features / 2`` wide."""

    # Buffers (register_buffer in __init__), declared for the type checker.
    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernel: str = "onednn", gated: bool = False) -> None:
        super().__init__()
        if kernel not in ("native", "onednn"):
            raise ValueError(f"unknown linear kernel {kernel!r}: 'native' or 'onednn'")
        if gated and kernel != "native":
            raise ValueError("only the native kernel applies silu(gate) * up itself (gated=True)")
        self.kernel = kernel
        self.gated = gated
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if kernel == "native":
            packed = native.pack_linear_weight(weight, gated=gated)
            # Added to the float32 sums before rounding. (Kept float32: do not cast the module.)
            bias = None if bias is None else bias.float()
        else:
            packed = _onednn_pack(weight)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ weight.T + bias, in ``x``'s dtype (gated: silu(gate) * up of it); with ``out_dtype``
        (float32 for logits) that result converted, which the native kernel does as it stores."""
        if x.dim() == 2 and self.kernel == "native" and x.stride(-1) == 1:  # the model's every call
            return native.linear_bf16(x, self.packed_weight, self.out_features, self.bias, out_dtype or x.dtype,
                                      self.gated)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of {x.shape[-1]} features to a linear layer of {self.in_features}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "native":
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = native.linear_bf16(rows, self.packed_weight, self.out_features, self.bias, out_dtype or x.dtype,
                                     self.gated)
        else:
            out = _onednn_linear(rows, self.packed_weight, self.bias)
            if out_dtype is not None:
                out = out.to(out_dtype)
        return out.view(*lead, out.shape[-1])


def packing_works(dtype: torch.dtype, device: torch.device) -> bool:
    """True where oneDNN's packed linears apply and give the same result as ``F.linear`` (checked once)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        return torch.equal(_onednn_linear(x, _onednn_pack(weight), None), F.linear(x, weight))
    except (RuntimeError, AttributeError) as e:  # an op missing from this PyTorch build
        logger.info("oneDNN packed linear unavailable (%s); using nn.Linear", e)
        return False


def linear_kernel(dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel packed linears use for this dtype and device, or None (``nn.Linear`` stays)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if native.linear_supported():
        return "native"
    return "onednn" if packing_works(dtype, device) else None


def pack_linear_layers(model: nn.Module, dtype: torch.dtype, device: torch.device, gated: bool = True) -> int:
    """Replace every loaded ``nn.Linear`` of ``model`` by a ``PackedLinear`` where that helps.

    Call after the weights are loaded. Returns how many layers were packed (0 where packing
    does not apply). A tied LM head gets its own packed copy; the embedding keeps the original.
    With the native kernel, the child a module names as its ``gated_projection`` is packed gated (unless
    ``gated`` is False: LoRA adapters add to gate and up before the activation).
    """
    kernel = linear_kernel(dtype, device)
    if kernel is None:
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                is_gated = gated and kernel == "native" and getattr(module, "gated_projection", None) == name
                setattr(module, name, PackedLinear(child, kernel, is_gated))
                count += 1
    if count:
        logger.info("packed %d linear layers for the %s bfloat16 kernel", count, kernel)
    return count
