"""Speculative decoding's configuration (vLLM's keys and defaults) and the n-gram proposer."""

from __future__ import annotations

import pytest

from pagellm.core.speculation import SpeculationState, SpeculativeConfig, propose_ngram


def test_the_proposal_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]
    # The suffix (2, 3) occurs at 1-2 and 5-6: the latest, 5-6, was followed by 7, 6, 5.
    assert propose_ngram(tokens, 3, 1, 2) == [7, 6, 5]
    # A longer match wins over a later one: (1, 2, 3) ... (1, 2, 3) beats the (2, 3) in between.
    tokens = [1, 2, 3, 4, 4, 9, 2, 3, 0, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [4, 4]
    # Fewer tokens than asked where the context ends first, none where nothing matched.
    assert propose_ngram([5, 6, 7, 5, 6], 4, 2, 2) == [7, 5, 6]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 1], 3, 2, 3) == []  # (a 1-token match is below prompt_lookup_min)


def test_the_configuration_takes_vllms_keys_and_defaults():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert spec.method == "ngram" and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 6, "disable_by_batch_size": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.disable_by_batch_size) == (2, 6, 4)
    # A "model" means a draft model, as in vLLM.
    spec = SpeculativeConfig.from_dict({"model": "org/draft", "num_speculative_tokens": 3})
    assert spec.uses_draft_model and spec.model == "org/draft" and spec.num_speculative_tokens == 3


@pytest.mark.parametrize(("raw", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model .*got 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer from 1 to 32, got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 32"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) is above prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "ngram_size": 3}, "unknown key.*'ngram_size'"),
    ({"model": "draft-folder", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size must be 1"),
    ({"method": "ngram", "model": "draft-folder", "num_speculative_tokens": 2}, "unknown key.*'model'"),
])
def test_a_wrong_configuration_is_named(raw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)


def test_a_sequence_whose_drafts_are_mostly_rejected_pauses():
    state = SpeculationState()
    state.record(8, 6, step=1)
    state.record(8, 5, step=2)
    assert state.paused_until == 0  # 11 of 16 accepted
    state.record(16, 1, step=3)
    assert state.paused_until > 3
