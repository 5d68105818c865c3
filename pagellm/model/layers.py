"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import native


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with the residual stream, (norm(x + residual), x + residual), the sum written
        into ``residual``'s memory where the native kernel runs (it is the caller's running sum)."""
        out = native.rms_norm(x, self.weight, self.eps, residual)  # one pass instead of six (seven)
        if residual is None:
            return out if out is not None else self.reference(x)
        if out is not None:
            return out, residual
        total = x + residual
        return self.reference(total), total

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_parameters(config: Any) -> dict:
    """The rotary settings of an HF config, whichever transformers version wrote it.

    transformers >= 5 keeps them in ``config.rope_parameters`` (with ``rope_theta``
    inside); older versions have ``rope_theta`` and ``rope_scaling`` attributes.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (neox-style rotate-half)."""

    # Buffers (register_buffer in __init__), declared for the type checker.
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            # The scaled variants are transformers' own functions: one source of truth.
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # (max_position, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def rotate_qk_(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        """In place on a fused projection's q and k columns (its first heads), by the native kernel;
        False where it does not apply (then use ``forward``)."""
        return native.rotary_(qkv, num_heads + num_kv_heads, self.cos.shape[-1], positions, self.cos, self.sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (num_tokens, 1, head_dim)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    # The projection whose output is [gate | up]: a packed native linear applies silu(gate) * up itself.
    gated_projection = "gate_up_proj"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gated", False):
            return self.down_proj(self.gate_up_proj(x))  # silu(gate) * up as the matmul stores it
        gate_up = self.gate_up_proj(x)
        act = native.silu_and_mul(gate_up)  # one pass instead of two
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)
