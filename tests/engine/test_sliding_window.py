"""Models whose every layer attends to a window: the blocks that fall out of it go back to the pool,
and the tokens stay transformers' (batched, alone, chunked, preempted by swap and by recompute)."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import OUT_OF_WINDOW
from pagellm.model.default_model import build_checkpoint
from tests.helpers import assert_all_blocks_free
from tests.model.family_parity import assert_family_matches_transformers, family_prompts, transformers_greedy

WINDOW = 12


@pytest.fixture(scope="module")
def windowed_path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mistral-window"), "mistral", seed=4, num_key_value_heads=2,
                            sliding_window=WINDOW, initializer_range=0.2)


def test_windowed_model_matches_transformers_while_blocks_are_freed(windowed_path):
    prompts = family_prompts(seed=4)
    expected = transformers_greedy(windowed_path, prompts)
    # A sequence past its prompt holds 2 or 3 blocks of 16: only a pool this small still preempts.
    for mode in ("swap", "recompute"):
        assert_family_matches_transformers(windowed_path, prompts, expected, preemption_mode=mode, num_kv_blocks=11,
                                           block_size=16)


def test_a_long_generation_holds_only_the_window(windowed_path):
    llm = LLM(str(windowed_path), max_model_len=512, num_kv_blocks=128, block_size=4)
    manager = llm.llm_engine.kv_cache_manager
    peak: list[int] = []

    class UsedBlocks:
        def executed(self, engine, scheduler_output, seconds):
            pass

        def updated(self, engine):
            peak.append(manager.groups[0].pool.num_used_blocks)

    llm.llm_engine.step_observers.append(UsedBlocks())
    (out,) = llm.generate([list(range(5, 105))], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 300  # 400 tokens: 100 blocks of 4 without freeing
    # The window's 12 tokens, the block being written and the one allocated ahead at most.
    assert max(peak[1:]) <= WINDOW // 4 + 2
    assert_all_blocks_free(llm)


def test_out_of_window_entries_keep_the_table_positions(windowed_path):
    llm = LLM(str(windowed_path), max_model_len=128, num_kv_blocks=32, block_size=4)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": list(range(5, 45))},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt's 40 tokens: blocks 0..6 are out of a 12-token window
    (seq,) = engine.requests["r"].seqs
    table = engine.kv_cache_manager.groups[0].block_tables[seq.seq_id]
    assert len(table) == 10 and table[:7] == [OUT_OF_WINDOW] * 7 and OUT_OF_WINDOW not in table[7:]
    engine.kv_cache_manager.assert_consistent()
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
