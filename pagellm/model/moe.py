"""Mixtures of experts on the Llama layers: Mixtral and Qwen3-MoE.

The attention, norms, rotary embedding and paged KV cache are llama.py's; the gated MLP of a layer
is replaced by a sparse block: a router picks ``top_k`` experts per token, each expert (a gated silu
MLP, gate and up fused like ``GatedMLP`` so packed linears apply) runs only on the tokens routed to
it, and the outputs are summed weighted by the router's probabilities. Qwen3-MoE adds q/k norms
(llama.py's ``qk_norm``) and may keep a dense MLP on some layers (``mlp_only_layers``,
``decoder_sparse_step``).

Checkpoints name each expert's projections (Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3``,
Qwen3-MoE's ``mlp.experts.E.gate_proj/up_proj/down_proj``), which is what transformers'
``save_pretrained`` writes; transformers >= 5 keeps the experts fused in memory (3-D
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``), so that layout is accepted too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.layers import GatedMLP
from pagellm.model.llama import LlamaForCausalLM, dense_mlp
from pagellm.model.quant_linear import QuantizedWeight, step_prompt_rows


class SparseMoeBlock(nn.Module):
    """Top-k routed experts over a flat batch of tokens; only the experts some token picked run.

    ``renormalize``: the top-k probabilities are divided by their sum. ``float32_weights``: the
    routing weights stay float32 (Mixtral), so each weighted expert output is float32 until the sum;
    otherwise they are rounded to the model's dtype first (Qwen3-MoE), as transformers does.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, float32_weights: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.float32_weights = float32_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (num_tokens, hidden) -> (weights (num_tokens, top_k), expert ids (num_tokens, top_k)),
        the most probable expert first."""
        logits = self.gate(x)  # (num_tokens, num_experts), in the model's dtype
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden) -> (num_tokens, hidden)."""
        num_tokens, hidden = x.shape
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)  # (num_tokens * top_k,): slot t * top_k + j = token t's j-th pick
        flat_weights = weights.reshape(-1, 1)  # (num_tokens * top_k, 1)
        # Slots grouped by expert, so each expert reads its tokens in one gather and runs once. The
        # same (unstable) sort as transformers: its rows then reach each matmul in the same order,
        # and a row's float32 sums can depend on where it sits in the matmul.
        order = torch.sort(flat_experts).indices  # (num_tokens * top_k,)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out_dtype = torch.promote_types(x.dtype, weights.dtype)
        # Every slot belongs to exactly one expert, so every row is written below.
        weighted = torch.empty(num_tokens * self.top_k, hidden, dtype=out_dtype, device=x.device)
        start = 0
        with step_prompt_rows(None):  # an expert's rows are gathered: not the step's
            for expert, count in zip(self.experts, counts):
                if count == 0:
                    continue  # no token picked this expert: it does not run
                slots = order[start:start + count]  # (count,)
                start += count
                y = expert(x.index_select(0, slots // self.top_k))  # (count, hidden)
                weighted.index_copy_(0, slots, y * flat_weights[slots])
        # Each token's top_k outputs summed in one reduction, in pick order, as transformers' default
        # experts implementation (grouped_mm) sums them (a bfloat16 sum accumulates in float32 and
        # rounds once).
        return weighted.view(num_tokens, self.top_k, hidden).sum(dim=1).to(x.dtype)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama model with sparse MoE blocks; subclasses say which layers have them and how they route."""

    # The native decode driver runs dense Llama layers only.
    native_step_driver = False

    # Checkpoint name pieces -> ours (a family's older spellings).
    renames: dict[str, str] = {}

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return self.make_moe(config) if self.is_sparse(config, layer_idx) else dense_mlp(config)

    def is_sparse(self, config: PretrainedConfig, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has a sparse MoE block (else the dense MLP)."""
        return True

    def make_moe(self, config: PretrainedConfig) -> SparseMoeBlock:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """As ``LlamaForCausalLM.load_weights``, with per-expert or fused expert weights; names in
        errors are the per-expert ones in this module's spelling (``mlp.experts.E.gate_proj``)."""
        super().load_weights(self.per_expert_weights(weights))

    def per_expert_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
                           ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Checkpoint tensors with renamed pieces, fused experts split into per-expert ones (fused
        experts come dequantized: only 2-D GGUF tensors stay in their blocks)."""
        for name, tensor in weights:
            for old, new in self.renames.items():
                name = name.replace(old, new)
            if isinstance(tensor, QuantizedWeight):
                yield name, tensor
            elif name.endswith(".experts.gate_up_proj"):  # (num_experts, 2 * intermediate, hidden)
                prefix = name[: -len("gate_up_proj")]
                for e, fused in enumerate(tensor):
                    gate, up = fused.chunk(2, dim=0)  # gate rows first, as transformers fuses them
                    yield f"{prefix}{e}.gate_proj.weight", gate
                    yield f"{prefix}{e}.up_proj.weight", up
            elif name.endswith(".experts.down_proj"):  # (num_experts, hidden, intermediate)
                prefix = name[: -len("down_proj")]
                for e, down in enumerate(tensor):
                    yield f"{prefix}{e}.down_proj.weight", down
            else:
                yield name, tensor


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: every layer sparse, top-k probabilities renormalized, routing weights in float32."""

    renames = {
        ".block_sparse_moe.": ".mlp.",
        ".w1.weight": ".gate_proj.weight",
        ".w3.weight": ".up_proj.weight",
        ".w2.weight": ".down_proj.weight",
    }

    def make_moe(self, config: PretrainedConfig) -> SparseMoeBlock:
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                              config.num_experts_per_tok, renormalize=True, float32_weights=True)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: q/k norms; sparse layers every ``decoder_sparse_step`` except ``mlp_only_layers``;
    renormalized only with ``norm_topk_prob``; routing weights rounded to the model's dtype."""

    def is_sparse(self, config: PretrainedConfig, layer_idx: int) -> bool:
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)

    def make_moe(self, config: PretrainedConfig) -> SparseMoeBlock:
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                              float32_weights=False)
