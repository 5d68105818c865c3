"""Incremental detokenisation: several tokens at once release what one at a time would."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagellm.engine.detokenizer import IncrementalDetokenizer


def test_add_tokens_releases_what_adding_one_at_a_time_does(llama_path):
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    prompt = tok.encode("Say it:")
    ids = tok.encode(" naïve café 🙂 ok, déjà vu 🎉")  # multi-byte characters split over byte tokens
    assert len(ids) > len(" naïve café 🙂 ok, déjà vu 🎉".split())  # some characters span several tokens
    for cut in range(len(ids) + 1):  # every split point, inside characters included
        one = IncrementalDetokenizer(tok, prompt)
        many = IncrementalDetokenizer(tok, prompt)
        streamed = "".join(one.add(t) for t in ids[:cut])
        assert many.add_tokens(ids[:cut]) == streamed
        assert many.num_tokens == one.num_tokens == cut
        rest = "".join(one.add(t) for t in ids[cut:]) + one.flush()
        assert many.add_tokens(ids[cut:]) + many.flush() == rest
        assert streamed + rest == tok.decode(ids)
