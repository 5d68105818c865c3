"""Token bitmasks and their application in the sampler."""

from __future__ import annotations

import torch

from pagellm.structured_output.bitmask import GrammarMask, allocate_bitmask, allowed, apply_token_bitmask, set_only


def test_set_only_and_allowed_every_bit_position():
    mask = allocate_bitmask(1, 70)
    assert allowed(mask, 70).all()
    set_only(mask[0], [0, 31, 32, 63, 69])
    assert allowed(mask, 70)[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]


def test_only_the_constrained_rows_change():
    logits = torch.randn(3, 40)
    before = logits.clone()
    bitmask = allocate_bitmask(1, 40)
    set_only(bitmask[0], [5, 7])
    apply_token_bitmask(logits, GrammarMask([1], bitmask))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 7]
    assert torch.equal(logits[1, [5, 7]], before[1, [5, 7]])


def test_a_row_left_empty_falls_back_to_the_grammar_alone():
    raw = torch.randn(1, 16)
    processed = raw.clone()
    processed[0, 3] = float("-inf")  # e.g. min_tokens banning the EOS the grammar requires
    bitmask = allocate_bitmask(1, 16)
    set_only(bitmask[0], [3])
    apply_token_bitmask(processed, GrammarMask([0], bitmask), unprocessed=raw)
    assert processed[0].argmax().item() == 3 and processed[0, 3] == raw[0, 3]
