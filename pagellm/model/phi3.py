"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini) on the Llama layers.

What differs from Llama: the checkpoint stores the fused projections (``qkv_proj``, ``gate_up_proj``)
as ours, so its names map one to one; the rotation may cover only the first ``partial_rotary_factor``
of each head's dims; and "longrope" scaling has short and long frequencies (Phi3RotaryEmbedding in
layers.py). transformers picks the long ones for a whole forward once its sequence is longer than
``original_max_position_embeddings``; here each sequence of the batch is judged alone, by the length
its whole sequence has, so sequences on either side of that length share a step. As transformers'
``generate`` does (it drops its cache there), a sequence that first grows past the original length
is computed again from its first token with the long factors: the scheduler sends it back to the
waiting queue at that length, and the prefix cache keys blocks by the side of the length their
sequence was on, so that short-factor keys never serve a long sequence. Every chunk of a long
prompt reads the long factors, as the whole prompt does in one forward.
A window (``sliding_window``) is the model-wide one, as for Mistral; there are no biases.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import PretrainedConfig

from pagellm.model.attention import AttentionMetadata, KVCache
from pagellm.model.layers import Phi3RotaryEmbedding, rope_parameters
from pagellm.model.llama import DecoderLayer, LlamaForCausalLM, head_dim_of


def step_lengths(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """(num_tokens,) for each row of the flat batch, how long its whole sequence is (every chunk of a
    long prompt, one-token chunks included, reads the factors the whole prompt would in one forward)."""
    lengths = positions + 1
    if meta.decode_seq_lens:  # rows [0, num_decodes): a prompt's one-token chunk is one of them too
        lengths[: len(meta.decode_seq_lens)] = torch.tensor(meta.decode_seq_lens, device=lengths.device)
    for span in meta.prefills:
        lengths[span.q_start : span.q_start + span.q_len] = span.seq_len or span.context_len
    return lengths


def longrope_switch_length(config: PretrainedConfig, max_model_len: int) -> int | None:
    """The length past which a longrope model (Phi-3) reads its long factors, where ``max_model_len``
    lets a sequence get past it; None for any other model. A sequence that grows past it is computed
    again from its first token, and the prefix cache keys blocks by the side of it they were computed
    on (see the module docstring)."""
    params = rope_parameters(config)
    if params.get("rope_type") != "longrope":
        return None
    original = int(params["original_max_position_embeddings"])
    return original if max_model_len > original else None


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi3: Llama layers with partial rotary and longrope, loaded from fused checkpoint weights."""

    # The native decode driver knows only Llama's full-head rotation over one table.
    native_step_driver = False

    # The checkpoint's fused projections are ours: no name is split into shards.
    stacked_params: dict[str, tuple[str, int]] = {}

    def make_rotary(self, config: PretrainedConfig, max_position: int) -> Phi3RotaryEmbedding:
        return Phi3RotaryEmbedding(config, head_dim_of(config), max_position)

    @property
    def rotary(self) -> Phi3RotaryEmbedding:
        """The rotary embedding the layers share."""
        return cast(Phi3RotaryEmbedding, cast(DecoderLayer, self.layers[0]).self_attn.rotary)

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,)
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; under longrope the layers get each token's row of the rotary
        tables in place of its position (the layers use positions for the rotation only)."""
        rotary = self.rotary
        if rotary.long_from is not None:
            positions = rotary.table_rows(positions, step_lengths(positions, meta))
        return super().forward(input_ids, positions, kv_caches, meta)
