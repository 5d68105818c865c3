"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

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


def rope_parameters(config: PretrainedConfig) -> dict:
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
    """Precomputed cos/sin tables indexed by absolute position (neox-style rotate-half) over the first
    ``rotary_dim`` dims of each head: all of them, or ``partial_rotary_factor`` of them where a scaled
    variant (transformers' functions) says so; the other dims pass through unrotated."""

    # Buffers (register_buffer in __init__), declared for the type checker.
    cos: torch.Tensor
    sin: torch.Tensor

    # The rope types this class builds (a subclass for a family with more widens it).
    rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in self.rope_types:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(self.rope_types)}")
        self.head_dim = head_dim
        cos, sin = self.build_tables(config, params, head_dim, max_position)  # (rows, rotary_dim) each
        self.rotary_dim = cos.shape[-1]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def build_tables(self, config: PretrainedConfig, params: dict, head_dim: int, max_position: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables, (max_position, rotary_dim) each."""
        if params["rope_type"] == "default":
            return rotary_tables(default_inv_freq(float(params["rope_theta"]), head_dim), 1.0, max_position)
        # The scaled variants are transformers' own functions: one source of truth.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
        return rotary_tables(inv_freq, scaling, max_position)

    def rotate_qk_(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
        """In place on a fused projection's q and k columns (its first heads), by the native kernel;
        False where it does not apply (then use ``forward``)."""
        if self.rotary_dim != self.head_dim:
            return False  # the kernel rotates whole heads
        return native.rotary_(qkv, num_heads + num_kv_heads, self.head_dim, positions, self.cos, self.sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (num_tokens, 1, rotary_dim)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class Phi3RotaryEmbedding(RotaryEmbedding):
    """Phi3's rules: the default rope too rotates only ``partial_rotary_factor`` of each head's dims,
    and "longrope" has two sets of frequencies, short (sequences up to original_max_position_embeddings
    tokens) and long, both scaled by its attention factor.

    Under longrope the tables stack the short rows (positions below the original length, the only ones
    a short sequence has) and then the long rows (every position); ``table_rows`` gives each token its
    row from how long its sequence is in the step, and the model passes those rows as positions.
    """

    rope_types = ("default", "longrope")

    # longrope: sequences longer than this read the long rows, from row long_offset on; None: one table.
    long_from: int | None = None
    long_offset: int = 0

    def build_tables(self, config: PretrainedConfig, params: dict, head_dim: int, max_position: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        # (transformers < 5 keeps the factor beside the rope settings, not among them)
        factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        rotary_dim = int(head_dim * float(factor))
        if params["rope_type"] == "default":
            return rotary_tables(default_inv_freq(float(params["rope_theta"]), rotary_dim), 1.0, max_position)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        longrope = ROPE_INIT_FUNCTIONS["longrope"]
        original = int(params["original_max_position_embeddings"])
        # Without seq_len it gives the short factors (and the attention factor both sets use).
        short_freq, scaling = longrope(config, torch.device("cpu"))
        short = rotary_tables(short_freq, scaling, min(original, max_position))
        if max_position <= original:
            return short  # no sequence gets longer than the original length
        long_freq, _ = longrope(config, torch.device("cpu"), seq_len=original + 1)
        long = rotary_tables(long_freq, scaling, max_position)
        self.long_from, self.long_offset = original, original
        return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))

    def table_rows(self, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) rows of the tables for tokens at ``positions`` whose sequences are ``lengths``
        tokens long in this step: the long rows where a sequence is longer than the original length."""
        if self.long_from is None:
            return positions
        return torch.where(lengths > self.long_from, positions + self.long_offset, positions)


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """(dim / 2,) inverse frequencies of the unscaled rope over ``dim`` dims."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rotary_tables(inv_freq: torch.Tensor, scaling: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin (max_position, 2 * len(inv_freq)), times ``scaling``."""
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())  # (max_position, rotary_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim) rotated over its first cos.shape[-1] dims; the rest as they are."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head, rest = x[..., :dim], x[..., dim:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    # The projection whose output is [gate | up]: a packed native linear applies silu(gate) * up itself.
    gated_projection = "gate_up_proj"
    # A tensor-parallel rank's share, where sharded (distributed/sharding.py): PEFT module -> (start, end, whole).
    tp_spans: dict[str, tuple[int, int, int]] | None = None

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
