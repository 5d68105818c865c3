"""SamplingParams validation: each bad value names its field, its value and the allowed range."""

from __future__ import annotations

import pytest

from pagellm import SamplingParams


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n=0), "n must be an integer >= 1, got 0"),
        (dict(n=2, best_of=1), "best_of must be an integer >= n (2), got 1"),
        (dict(temperature=-1), "temperature must be a number in [0, 100] (0 is greedy), got -1"),
        (dict(top_p=0), "top_p must be a number in (0, 1] (1 disables it), got 0"),
        (dict(top_p=1.5), "top_p must be a number in (0, 1]"),
        (dict(top_k=-2), "top_k must be an integer >= 1, or 0 or -1 to disable it, got -2"),
        (dict(min_p=2), "min_p must be a number in [0, 1]"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(max_tokens=5, min_tokens=6), "min_tokens must be <= max_tokens (5), got 6"),
        (dict(presence_penalty=3), "presence_penalty must be a number in [-2, 2], got 3"),
        (dict(frequency_penalty=-2.5), "frequency_penalty must be a number in [-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number in (0, 10]"),
        (dict(logprobs=-1), "logprobs must be an integer >= 0 or None"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs must be an integer >= 0 or None"),
        (dict(stop=[""]), "stop must be a non-empty string or a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative token ids"),
        (dict(seed="x"), "seed must be an integer in [-2**63, 2**64 - 1]"),
        (dict(seed=2**64), "seed must be an integer in [-2**63, 2**64 - 1]"),
        (dict(seed=-(2**63) - 1), "seed must be an integer in [-2**63, 2**64 - 1]"),
        (dict(logit_bias={-1: 5.0}), "logit_bias must be a dict of token id (>= 0) -> bias in [-100, 100]"),
        (dict(logit_bias={3: float("nan")}), "logit_bias must be a dict of token id (>= 0)"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(skip_special_tokens="no"), "skip_special_tokens must be True or False, got 'no'"),
        (dict(ignore_eos=1), "ignore_eos must be True or False, got 1"),
        (dict(stop=["a"], detokenize=False), "stop must be None when detokenize=False"),
    ],
)
def test_invalid_values_are_named(fields, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert message in str(e.value)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop_strings == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert g.is_greedy and (g.top_p, g.top_k) == (1.0, 0)
    assert p.clone(max_tokens=3).max_tokens == 3


def test_the_whole_seed_range_is_taken():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_stop_strings_are_bounded():
    from pagellm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    SamplingParams(stop=["x" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS)  # at the limits
    with pytest.raises(ValueError, match=rf"stop must have at most {MAX_STOP_STRINGS} strings, got 100"):
        SamplingParams(stop=["x"] * 100)
    with pytest.raises(ValueError, match=rf"stop must have at most {MAX_STOP_CHARS} characters in all, got 100000"):
        SamplingParams(stop=["x" * 50_000, "y" * 50_000])


def test_clone_starts_with_its_own_stop_tables():
    p = SamplingParams(stop=["ab"])
    p.stop_tables["ab"] = [0, 0]
    q = p.clone(max_tokens=3)
    assert q.stop_strings == ["ab"] and q.stop_tables == {} and q == p.clone(max_tokens=3)
