"""Qwen3 (per-head q/k RMSNorm before the rotation) against transformers."""

from __future__ import annotations

import pytest

from pagellm.model.default_model import build_checkpoint
from tests.model.family_parity import (
    assert_bfloat16_logprobs_close,
    assert_family_matches_transformers,
    family_prompts,
    transformers_greedy,
)

SHAPES = {
    "qwen3": dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, initializer_range=0.2),
    "qwen3-hd64-bias": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, attention_bias=True,
                            initializer_range=0.2),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def qwen3_path(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), "qwen3", seed=3, **SHAPES[request.param])


def test_qwen3_greedy_matches_transformers(qwen3_path):
    prompts = family_prompts(seed=3)
    assert_family_matches_transformers(qwen3_path, prompts, transformers_greedy(qwen3_path, prompts))


def test_qwen3_bfloat16_logprobs_close(qwen3_path):
    assert_bfloat16_logprobs_close(qwen3_path)
