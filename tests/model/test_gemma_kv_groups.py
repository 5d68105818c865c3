"""Gemma's KV cache groups end to end: the sliding layers' blocks that fall out of their window go back
to their own pool while the full-attention layers keep theirs, the tokens stay transformers' (block
sizes 1, 4 and 16, forced preemption by swap and by recompute, prefix caching), no block leaks, and
more long sequences run at once than with one block table for every layer."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import cdiv, is_held
from pagellm.core.kv_groups import KVCacheGroupSpec
from pagellm.engine import startup
from pagellm.engine.kv_state import kv_state
from pagellm.model.default_model import build_checkpoint
from tests.helpers import assert_all_blocks_free, random_prompts
from tests.model.family_parity import transformers_greedy
from tests.model.test_gemma import SHAPES, perturb

WINDOW = 8
NEW_TOKENS = 40
MAX_MODEL_LEN = 160
# Prompts across the window and past many blocks; 40 new tokens each: every sequence outgrows the window.
PROMPTS = random_prompts([3, 17, 40, 100], vocab=500, seed=9)
CASES = {"gemma2": ("gemma2", "gemma2-gqa-w8"), "gemma3": ("gemma3_text", "gemma3-gqa-w8")}


@pytest.fixture(scope="module", params=sorted(CASES))
def gemma_path(request, tmp_path_factory):
    arch, shape = CASES[request.param]
    assert SHAPES[arch][shape]["sliding_window"] == WINDOW
    path = build_checkpoint(tmp_path_factory.mktemp(shape), arch, seed=5, **SHAPES[arch][shape])
    perturb(path, seed=5)
    return path


@pytest.fixture(scope="module")
def expected(gemma_path):
    tokens = transformers_greedy(gemma_path, PROMPTS, NEW_TOKENS)
    assert all(len(set(t)) > 3 for t in tokens)  # not a degenerate model
    return tokens


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tokens_match_transformers_with_a_pool_per_kind_of_layer(gemma_path, expected, block_size):
    # Plenty of blocks, then prefix caching: the second run of the same prompts hits in both groups.
    llm = LLM(str(gemma_path), max_model_len=MAX_MODEL_LEN, block_size=block_size,
              num_kv_blocks=4 * cdiv(MAX_MODEL_LEN, block_size), enable_prefix_caching=True)
    manager = llm.llm_engine.kv_cache_manager
    assert len(manager.groups) == 2
    full, sliding = manager.groups
    assert (full.sliding_window, sliding.sliding_window) == (None, WINDOW)
    assert generate(llm, PROMPTS) == expected
    assert_all_blocks_free(llm)
    hits = manager.prefix_cache_hits
    assert generate(llm, PROMPTS) == expected
    assert manager.prefix_cache_hits > hits
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tokens_match_transformers_under_preemption(gemma_path, expected, block_size, mode):
    # The fewest blocks one sequence of max_model_len needs, and the shorter prompts twice: the running
    # sequences outgrow the full-attention pool and are preempted on the way.
    llm = LLM(str(gemma_path), max_model_len=MAX_MODEL_LEN, block_size=block_size,
              num_kv_blocks=cdiv(MAX_MODEL_LEN, block_size), preemption_mode=mode, swap_space=0.05,
              max_num_batched_tokens=64, max_num_seqs=64, enable_prefix_caching=mode == "recompute")
    order = [0, 1, 2, 0, 1, 2, 3]
    assert generate(llm, [PROMPTS[i] for i in order]) == [expected[i] for i in order]
    stats = llm.llm_engine.scheduler.stats
    assert (stats.num_swap_outs if mode == "swap" else stats.num_recomputes) > 0
    assert_all_blocks_free(llm)


def test_the_sliding_group_holds_only_the_window(gemma_path):
    llm = LLM(str(gemma_path), max_model_len=512, num_kv_blocks=128, block_size=4)
    manager = llm.llm_engine.kv_cache_manager
    assert len(manager.groups) == 2
    full, sliding = manager.groups
    held: list[tuple[int, int]] = []

    class HeldBlocks:
        def executed(self, engine, scheduler_output, seconds):
            pass

        def updated(self, engine):
            for seq in engine.scheduler.running:
                held.append(tuple(sum(map(is_held, g.block_tables[seq.seq_id])) for g in (full, sliding)))

    llm.llm_engine.step_observers.append(HeldBlocks())
    (tokens,) = generate(llm, [list(range(5, 105))], max_tokens=300)
    assert len(tokens) == 300
    assert max(s for _, s in held) <= cdiv(WINDOW, 4) + 1  # 400 tokens: 100 blocks of 4 without freeing
    assert [f for f, _ in held] == sorted(f for f, _ in held) and held[-1][0] >= 99  # the full group keeps all
    assert_all_blocks_free(llm)
    for group in manager.groups:  # every group's pool is whole again
        assert group.pool.num_free_blocks == group.pool.num_blocks
    # The dashboard's state counts each group's blocks.
    state = kv_state(manager, llm.llm_engine.scheduler)
    assert [(g["sliding_window"], g["num_blocks"], g["used_blocks"]) for g in state["groups"]] == \
        [(None, full.pool.num_blocks, 0), (WINDOW, sliding.pool.num_blocks, 0)]
    assert state["pool"]["num_blocks"] == full.pool.num_blocks


def test_more_long_sequences_run_at_once_than_with_one_table(gemma_path, monkeypatch):
    """The same KV memory: one block table for every layer, then a pool per kind of layer."""
    prompts = random_prompts([60] * 8, vocab=500, seed=3)

    def run() -> tuple[list[list[int]], int, int]:
        llm = LLM(str(gemma_path), max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=80,
                  max_num_batched_tokens=64, max_num_seqs=8)
        most = 0

        class LongRunning:
            def executed(self, engine, scheduler_output, seconds):
                pass

            def updated(self, engine):
                nonlocal most
                most = max(most, sum(1 for s in engine.scheduler.running if s.num_tokens >= 100))

        llm.llm_engine.step_observers.append(LongRunning())
        tokens = generate(llm, prompts, max_tokens=60)
        assert_all_blocks_free(llm)
        return tokens, most, llm.llm_engine.scheduler.stats.num_preemptions

    grouped, grouped_most, grouped_preemptions = run()
    monkeypatch.setattr(startup, "kv_cache_groups",  # one table for every layer
                        lambda config, num_layers: [KVCacheGroupSpec(tuple(range(num_layers)), None)])
    shared, shared_most, shared_preemptions = run()
    assert grouped == shared
    assert shared_most <= 80 // cdiv(100, 4)  # 25 blocks each
    assert grouped_most > shared_most and grouped_preemptions < shared_preemptions


def test_samples_beams_and_pinned_prefixes_share_blocks_in_every_group(gemma_path, expected):
    import torch

    from pagellm import BeamSearchParams
    from tests.helpers import hf_model

    llm = LLM(str(gemma_path), max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=160,
              enable_prefix_caching=True)
    manager = llm.llm_engine.kv_cache_manager
    assert len(manager.groups) == 2
    # n = 3 greedy samples fork from the prompt's blocks (copy-on-write of the shared partial block).
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [expected[2]] * 3
    assert_all_blocks_free(llm)
    # Beam search: beams share their parents' blocks through the prefix cache, in both groups.
    prompt = PROMPTS[1]
    (beams,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=12))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf_model(gemma_path).generate(ids, attention_mask=torch.ones_like(ids), num_beams=2,
                                            num_return_sequences=2, do_sample=False, max_new_tokens=12,
                                            length_penalty=1.0, pad_token_id=0)
    assert [s.output_token_ids for s in beams.sequences] == [r[len(prompt):].tolist() for r in ref]
    assert_all_blocks_free(llm)
    # A pinned prompt hits in both groups however many blocks went through the pools since.
    pinned = llm.preload_prefixes([PROMPTS[3]])
    full, sliding = manager.groups  # the whole prompt in the full group, its window in the sliding one
    assert len(full.pinned) == 25 and 0 < len(sliding.pinned) < 25 and pinned == 25 + len(sliding.pinned)
    generate(llm, random_prompts([100] * 6, vocab=500, seed=8), max_tokens=8)
    (hit,) = llm.generate([PROMPTS[3] + [7]], greedy(4), use_tqdm=False)
    assert hit.num_cached_tokens == 100
    manager.assert_consistent()
    assert llm.llm_engine.unpin_prefixes() == pinned and not any(g.pinned for g in manager.groups)
    assert_all_blocks_free(llm)
    assert llm.reset_prefix_cache() and not any(g.pool.cached_blocks for g in manager.groups)


def test_a_disk_tier_serves_both_groups_to_a_new_engine(gemma_path, expected, tmp_path):
    # One engine computes the prompts and a small pool evicts them to disk; a new engine on the same
    # folder reads each group's blocks back and ends with the same tokens.
    kw = dict(max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=2 * cdiv(MAX_MODEL_LEN, 4), max_num_seqs=1,
              swap_space=0, kv_offload_dir=str(tmp_path / "tier"))
    first = LLM(str(gemma_path), **kw)
    assert generate(first, PROMPTS) == expected
    generate(first, random_prompts([140, 140], vocab=500, seed=2), max_tokens=1)  # evicts the prompts' blocks
    first.llm_engine.shutdown()
    second = LLM(str(gemma_path), **kw)
    manager = second.llm_engine.kv_cache_manager
    assert generate(second, PROMPTS) == expected
    assert manager.disk is not None and manager.disk.hit_blocks > 0
    assert_all_blocks_free(second)
    second.llm_engine.shutdown()
