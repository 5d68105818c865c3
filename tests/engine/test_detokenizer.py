"""Incremental detokenisation: several tokens at once release what one at a time would."""

from __future__ import annotations

import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagellm.engine.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    find_stop_string,
    stop_prefix_len,
    stop_string_table,
)


def test_add_tokens_releases_what_adding_one_at_a_time_does(llama_path):
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    prompt = tok.encode("Say it:")
    ids = tok.encode(" naïve café 🙂 ok, déjà vu 🎉")  # multi-byte characters split over byte tokens
    assert len(ids) > len(["naïve", "café", "🙂", "ok,", "déjà", "vu", "🎉"])  # some characters span several tokens
    for cut in range(len(ids) + 1):  # every split point, inside characters included
        one = IncrementalDetokenizer(tok, prompt)
        many = IncrementalDetokenizer(tok, prompt)
        streamed = "".join(one.add(t) for t in ids[:cut])
        assert many.add_tokens(ids[:cut]) == streamed
        assert many.num_tokens == one.num_tokens == cut
        rest = "".join(one.add(t) for t in ids[cut:]) + one.flush()
        assert many.add_tokens(ids[cut:]) + many.flush() == rest
        assert streamed + rest == tok.decode(ids)


# ------------------------------------------------------------- stop strings
def naive_find(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends in the last ``new_chars`` characters (first listed on a tie)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


def naive_hold(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


# Few letters, so that stop strings overlap themselves and the text often.
letters = st.text(alphabet="abé", min_size=0, max_size=12)
stop_lists = st.lists(st.text(alphabet="abé", min_size=1, max_size=6), min_size=1, max_size=4)


def test_stop_string_table_is_the_kmp_failure_function():
    for stop in ["a", "aaaa", "abab", "aabaaab", "abcabcab", "xyz"]:
        expected = [max((k for k in range(1, i + 1) if stop[: i + 1].endswith(stop[:k])), default=0)
                    for i in range(len(stop))]
        assert stop_string_table(stop) == expected, stop


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(letters, min_size=1, max_size=8), stops=stop_lists)
def test_incremental_stop_matching_equals_the_naive_search(chunks, stops):
    matcher = StopStringMatcher(stops)
    late = None  # one made after the first chunk, fed from where a hold-back can start (as a stream does)
    text = ""
    for chunk in chunks:
        text += chunk
        assert matcher.feed(chunk) == naive_find(text, len(chunk), stops)
        assert matcher.hold == naive_hold(text, stops)
        if late is None:
            late = StopStringMatcher(stops, start=max(0, len(text) - max(map(len, stops)) + 1))
        late.feed(text[late.length:])
        assert late.hold == naive_hold(text, stops)
        # The one-shot forms agree too.
        assert find_stop_string(text, len(chunk), stops) == naive_find(text, len(chunk), stops)
        assert stop_prefix_len(text, stops) == naive_hold(text, stops)


def test_tables_are_shared_and_built_only_when_a_partial_match_breaks():
    tables: dict[str, list[int]] = {}
    never = "q" * 5000
    a = StopStringMatcher(["ab", never], tables)
    assert a.feed("xxaxab") == ("ab", 4) and "ab" in tables and never not in tables
    b = StopStringMatcher(["ab", never], tables)
    table = tables["ab"]
    b.feed("aab")
    assert tables["ab"] is table  # the second matcher reused the first one's table


def test_stop_work_per_step_does_not_grow_with_the_text_or_the_stop_strings():
    """100 stop strings of 10,000 characters: a step costs what its new characters do, however long
    the text already is (the old prefix check rescanned 10,000 characters per stop string per step)."""
    rng = random.Random(0)
    stops = ["".join(rng.choice("abcdefgh ") for _ in range(10_000)) for _ in range(100)]
    steps = ["".join(rng.choice("abcdefgh ") for _ in range(5)) for _ in range(4_000)]
    matcher = StopStringMatcher(stops)

    def run(chunks: list[str]) -> float:
        t0 = time.perf_counter()
        for chunk in chunks:
            assert matcher.feed(chunk) is None
            assert matcher.hold < 10_000
        return time.perf_counter() - t0

    early = run(steps[:1_000])
    run(steps[1_000:3_000])
    late = run(steps[3_000:])  # the text is 15,000 characters longer than it was for `early`
    assert late < 3 * early + 0.1, (early, late)
    assert early < 10
