"""A loaded model cut to one tensor-parallel rank's share, in place (Megatron's split, as vLLM's).

Attention: each rank keeps ``num_heads / world`` query heads and their key/value heads: an equal
split of the KV heads where there are at least as many as ranks, else the one KV head its query
heads read (replicated over the ranks that share it, as vLLM does). ``qkv_proj`` keeps those rows
(column-parallel), ``o_proj`` the matching input columns (row-parallel), followed by an all-reduce.
MLP: each rank keeps ``intermediate_size / world`` of the gate and up rows and the matching columns
of ``down_proj``, followed by an all-reduce; a mixture of experts cuts every expert so and reduces
once, after the weighted sum of its experts. The embedding, the norms, the router and the LM head
stay whole on every rank. A bias of a row-parallel projection is added by rank 0 only: the
all-reduce sums the ranks' outputs.

Each sharded attention and dense MLP records its share as ``tp_spans`` (PEFT's module name -> (start,
end, whole width)): a column-parallel part's output rows, a row-parallel projection's input columns. A
LoRA adapter is cut by them as the base weights are (lora/weights.py): a part's B rows, o/down's A
columns; the all-reduce then sums base and adapter partials alike.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from pagellm.model.layers import GatedMLP
from pagellm.model.llama import Attention, LlamaForCausalLM, head_dim_of
from pagellm.model.moe import SparseMoeBlock


class AllReduced(nn.Module):
    """``inner``'s output summed over the tensor-parallel ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads each rank stores: an even share, or one (replicated) where there are fewer KV heads
    than ranks, as vLLM does. (engine/sizing.py sizes each rank's KV pool by it.)"""
    return max(1, -(-num_kv_heads // tensor_parallel_size))


def check_shardable(config: PretrainedConfig, world: int) -> None:
    """ValueError naming what does not divide when ``config``'s model is split over ``world`` ranks."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % world:
        raise ValueError(f"tensor_parallel_size {world} must divide the model's {heads} attention heads")
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"tensor_parallel_size {world} and the model's {kv_heads} key/value heads must divide "
                         "one another (an equal split of them, or each replicated over the same number of ranks)")
    sizes = {config.intermediate_size, getattr(config, "moe_intermediate_size", None) or config.intermediate_size}
    bad = sorted(s for s in sizes if s % world)
    if bad:
        raise ValueError(f"tensor_parallel_size {world} must divide the MLP's intermediate size {bad[0]}")


def sharded_config(config: PretrainedConfig, world: int) -> PretrainedConfig:
    """A copy of ``config`` with one rank's attention heads: what its KV cache and attention backend see."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    local = copy.copy(config)
    local.head_dim = head_dim_of(config)  # (derived from the whole head count where the config omits it)
    local.num_attention_heads = heads // world
    local.num_key_value_heads = kv_heads_per_rank(kv_heads, world)
    return local


def _rows(weight: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([weight[a:b] for a, b in spans]).contiguous()


def _shard_linear_rows(linear: nn.Linear, spans: list[tuple[int, int]]) -> None:
    linear.weight = nn.Parameter(_rows(linear.weight.data, spans), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, spans), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _shard_linear_columns(linear: nn.Linear, start: int, end: int, rank: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].contiguous(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = end - start


def shard_attention_(attn: Attention, rank: int, world: int) -> None:
    d, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    local_heads = heads // world
    if kv_heads >= world:
        local_kv = kv_heads // world
        first_kv = rank * local_kv
    else:  # each KV head replicated over world / kv_heads ranks
        local_kv = 1
        first_kv = rank * kv_heads // world
    q0 = rank * local_heads * d
    k0 = heads * d + first_kv * d
    v0 = heads * d + kv_heads * d + first_kv * d
    _shard_linear_rows(attn.qkv_proj, [(q0, q0 + local_heads * d), (k0, k0 + local_kv * d), (v0, v0 + local_kv * d)])
    _shard_linear_columns(attn.o_proj, q0, q0 + local_heads * d, rank)
    k_span = (first_kv * d, (first_kv + local_kv) * d, kv_heads * d)
    attn.tp_spans = {"q_proj": (q0, q0 + local_heads * d, heads * d), "k_proj": k_span, "v_proj": k_span,
                     "o_proj": (q0, q0 + local_heads * d, heads * d)}
    attn.add_module("o_proj", AllReduced(attn.o_proj))
    attn.num_heads, attn.num_kv_heads = local_heads, local_kv
    attn.q_size, attn.kv_size = local_heads * d, local_kv * d


def shard_mlp_(mlp: GatedMLP, rank: int, world: int, reduce: bool) -> None:
    size = mlp.intermediate_size
    local = size // world
    a = rank * local
    _shard_linear_rows(mlp.gate_up_proj, [(a, a + local), (size + a, size + a + local)])
    _shard_linear_columns(mlp.down_proj, a, a + local, rank)
    mlp.intermediate_size = local
    span = (a, a + local, size)
    mlp.tp_spans = {"gate_proj": span, "up_proj": span, "down_proj": span}
    if reduce:
        mlp.add_module("down_proj", AllReduced(mlp.down_proj))


def shard_for(rank: int, world: int) -> Callable[[LlamaForCausalLM], None] | None:
    """``loader.load_model``'s ``shard`` for rank ``rank`` of ``world``: ``shard_model_`` (None for one rank)."""
    return None if world == 1 else functools.partial(shard_model_, rank=rank, world=world)


def shard_model_(model: LlamaForCausalLM, rank: int, world: int) -> None:
    """Cut ``model`` (loaded whole, not yet packed) to rank ``rank``'s share of ``world``."""
    config = model.config
    check_shardable(config, world)
    in_moe: set[int] = set()
    for module in list(model.modules()):
        if isinstance(module, SparseMoeBlock):
            for expert in module.experts:
                shard_mlp_(expert, rank, world, reduce=False)  # type: ignore[arg-type]
                in_moe.add(id(expert))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SparseMoeBlock):
                setattr(parent, name, AllReduced(child))
    for module in list(model.modules()):
        if isinstance(module, Attention):
            shard_attention_(module, rank, world)
        elif isinstance(module, GatedMLP) and id(module) not in in_moe:
            shard_mlp_(module, rank, world, reduce=True)
    model.config = sharded_config(config, world)
    # The native step driver runs every layer in one call: no all-reduce between them.
    model.native_step_driver = False
