"""Phi3 (fused checkpoint projections, partial rotary, longrope, model-wide window) against transformers."""

from __future__ import annotations

import pytest
import torch

from pagellm.model.default_model import build_checkpoint
from pagellm.model.layers import Phi3RotaryEmbedding
from tests.helpers import hf_greedy, hf_model, random_prompts
from tests.model.family_parity import (
    assert_bfloat16_logprobs_close,
    assert_family_matches_transformers,
    assert_greedy_matches,
    family_prompts,
    greedy,
    transformers_greedy,
)

# head_dim 16: 12 rotated dims at partial_rotary_factor 0.75, so 6 short and 6 long factors.
ORIGINAL_LENGTH = 32
_factors = torch.Generator().manual_seed(4)
LONGROPE = dict(
    rope_type="longrope",
    short_factor=(1 + torch.rand(6, generator=_factors)).tolist(),
    long_factor=(1 + 4 * torch.rand(6, generator=_factors)).tolist(),
)

SHAPES = {
    "phi3": dict(initializer_range=0.2),
    "phi3-partial-gqa-window": dict(num_key_value_heads=2, partial_rotary_factor=0.75, sliding_window=24,
                                    initializer_range=0.2),
    # max_position_embeddings / original length = 8: an attention factor of ~1.27 on cos and sin.
    "phi3-longrope": dict(num_key_value_heads=2, partial_rotary_factor=0.75, max_position_embeddings=256,
                          original_max_position_embeddings=ORIGINAL_LENGTH, rope_scaling=LONGROPE,
                          initializer_range=0.2),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def phi3_path(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), "phi3", seed=5, **SHAPES[request.param])


@pytest.fixture(scope="module")
def longrope_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("phi3-longrope"), "phi3", seed=5, **SHAPES["phi3-longrope"])


# Under longrope: prompts that stay within the original length while generating 24 tokens (short
# factors), and prompts longer than it (long factors throughout).
LONGROPE_PROMPT_LENGTHS = [1, 3, 8, 33, 40, 100]


def test_phi3_greedy_matches_transformers(phi3_path):
    if "longrope" not in phi3_path.name:
        prompts = family_prompts(seed=5)
        # With a window, out-of-window blocks go back to the pool: only a smaller one still preempts.
        tight = dict(num_kv_blocks=10, block_size=16) if "window" in phi3_path.name else {}
        assert_family_matches_transformers(phi3_path, prompts, transformers_greedy(phi3_path, prompts), **tight)
        return
    prompts = random_prompts(LONGROPE_PROMPT_LENGTHS, vocab=500, seed=5)
    expected = transformers_greedy(phi3_path, prompts)
    for block_size in (1, 16):
        assert_greedy_matches(phi3_path, prompts, expected, block_size=block_size, num_kv_blocks=4096 // block_size)
    # Chunks of 16 tokens, and of 17 (decodes take one each, so that prompts are cut into chunks of
    # every length, one token among them): every chunk of a prompt longer than the original length
    # reads the long factors.
    for budget in (16, 17):
        llm = assert_greedy_matches(phi3_path, prompts, expected, block_size=16, num_kv_blocks=256,
                                    max_num_batched_tokens=budget, max_num_seqs=16)
        assert llm.llm_engine.scheduler.stats.num_partial_prefills > 0


def test_phi3_bfloat16_logprobs_close(phi3_path):
    # Prompts of 5 tokens (+16 generated: short factors throughout) and of 40 and 90 (long throughout).
    assert_bfloat16_logprobs_close(phi3_path)


CROSSING_LENGTHS = [20, 31, 32]  # + 24 generated tokens: each passes the original length while decoding


def test_phi3_longrope_crossing_matches_generate(longrope_path):
    """A sequence that grows past the original length is computed again with the long factors, as
    transformers' generate does, in a batch with sequences on either side of it; with prefix caching,
    the blocks computed with the short factors serve no sequence past the original length."""
    prompts = random_prompts(CROSSING_LENGTHS, vocab=500, seed=6) + random_prompts([3, 40], vocab=500, seed=7)
    expected = [hf_greedy(longrope_path, p, 24) for p in prompts]
    assert_greedy_matches(longrope_path, prompts, expected, block_size=16)
    # A shared 32-token prefix: the first prompts fill the cache with short-factor blocks, then the
    # longer one (long factors throughout) must not read them.
    shared = random_prompts([32], vocab=500, seed=8)[0]
    prompts = [shared[:20], shared + [7, 8, 9]]
    expected = [hf_greedy(longrope_path, p, 24) for p in prompts]
    llm = assert_greedy_matches(longrope_path, prompts[:1], expected[:1], block_size=4, enable_prefix_caching=True)
    (out,) = llm.generate([prompts[1]], greedy(24), use_tqdm=False)
    assert out.outputs[0].token_ids == expected[1]


def test_phi3_rotary_tables_and_partial_rotation(longrope_path):
    """Each token's row is the short table below the original length and the long one past it, as
    transformers' rotary embedding computes them; a partial rotation leaves the other dims and never
    takes the native whole-head kernel."""
    config = hf_model(longrope_path).config
    ours = Phi3RotaryEmbedding(config, 16, max_position=256)
    theirs = hf_model(longrope_path).model.rotary_emb
    positions = torch.tensor([0, 5, 31, 0, 5, 31, 32, 200])
    lengths = torch.tensor([1, 32, 32, 33, 33, 33, 33, 201])
    rows = ours.table_rows(positions, lengths)
    x = torch.zeros(1, len(positions), 16)
    for i in range(len(positions)):
        # transformers picks the factors from the largest position of the call: length - 1.
        want_cos, want_sin = theirs(x, torch.tensor([[int(positions[i]), int(lengths[i]) - 1]]))
        assert torch.equal(ours.cos[rows[i]], want_cos[0, 0]) and torch.equal(ours.sin[rows[i]], want_sin[0, 0])
    q, k = torch.randn(len(positions), 4, 16), torch.randn(len(positions), 2, 16)
    rq, rk = ours(rows, q, k)
    assert torch.equal(rq[..., 12:], q[..., 12:]) and torch.equal(rk[..., 12:], k[..., 12:])
    assert not ours.rotate_qk_(rows, torch.cat((q.flatten(1), k.flatten(1), k.flatten(1)), dim=1), 4, 2)
