"""The roofline counts every weight a decode step reads, whether or not the linears are packed."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM
from pagellm.bench.roofline import model_cost
from tests.helpers import hf_model


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # untied and tied LM heads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16 packs the linears on CPU
def test_weight_bytes_match_the_checkpoint(checkpoints, name, dtype):
    llm = LLM(str(checkpoints[name]), dtype=dtype, max_model_len=64, num_kv_blocks=16)
    reference = hf_model(checkpoints[name])
    # Everything but the embedding table (a decode step reads one row per token), plus the LM head
    # even when it is tied to that table.
    expected = sum(p.numel() for n, p in reference.named_parameters() if "embed_tokens" not in n)
    if reference.config.tie_word_embeddings:
        expected += reference.get_input_embeddings().weight.numel()
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    assert model_cost(llm).weight_bytes == expected * element
