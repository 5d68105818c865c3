"""Wrapping up constrained JSON: a document whose budget runs low or whose model loops still ends as
a document that parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.structured_output.bitmask import allocate_bitmask, allowed
from pagellm.structured_output.wrap_up import WrapUpMasks, is_looping, tokens_left

# Nothing bounds these strings and arrays: a random-weight model would write them until max_tokens.
UNBOUNDED = {
    "text": {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]},
    "list": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}},
                                              "count": {"type": "integer"}}, "required": ["items", "count"]},
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}, "required": ["b"]},
        "c": {"type": "string"}}, "required": ["a", "c"]},
    "top-level array": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}},
                                                   "required": ["k"]}},
}


def test_a_tail_that_repeats_a_short_run_is_a_loop():
    assert is_looping([7] * 70)
    assert is_looping(list(range(10)) + [1, 2, 3] * 22)
    assert is_looping(list(range(100, 120)) * 4)  # a 20-token item, four times
    assert not is_looping(list(range(100, 120)) * 3)
    assert not is_looping(list(range(200)))
    assert not is_looping([0, 1] * 16)  # 16 zeros in an array: too short to tell
    assert not is_looping([5] * 40 + list(range(40)))


def test_tokens_left_by_max_tokens_or_max_model_len():
    assert tokens_left(10, 400, 30, 1000) == 390
    assert tokens_left(500, None, 995, 1000) == 5  # no max_tokens: the model's length limit
    assert tokens_left(5, 16, 990, 1000) == 10


class CharTokenizer:
    """llguidance's tokenizer interface over a vocabulary of short strings."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.vocab_size = len(words)

    def is_special_token(self, token: int) -> bool:
        return self.words[token] == "<eos>"

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return "".join(self.words[t] for t in tokens).encode()


def test_the_mask_keeps_the_most_closing_class_it_can():
    words = ["<eos>", "a", '"', '"}', " ]", ",", ": ", "1", '"a', "}}"]
    masks = WrapUpMasks(CharTokenizer(words), len(words), [0])

    def narrowed(allowed_ids: list[int]) -> list[int]:
        row = torch.zeros_like(allocate_bitmask(1, len(words))[0])
        for t in allowed_ids:
            row |= torch.tensor(1 << t, dtype=torch.int32)
        masks.narrow(row)
        return allowed(row.unsqueeze(0), len(words))[0].nonzero().flatten().tolist()

    assert narrowed([0, 1, 3]) == [0]  # the end, when the document may end
    assert narrowed([1, 2, 3, 4, 5, 8, 9]) == [2, 3]  # the closing quote, and what it closes
    assert narrowed([1, 4, 5, 9]) == [4, 9]  # then other closers (a leading space is layout)
    assert narrowed([1, 5, 6, 7]) == [5, 6]  # then separators: a number ends, a key follows
    assert narrowed([1, 7, 8]) == [1, 7, 8]  # nothing closes: the grammar's choice stands
    row = torch.zeros_like(allocate_bitmask(1, len(words))[0]) | torch.tensor(0b1001, dtype=torch.int32)
    masks.narrow(row, may_end=False)  # min_tokens not reached: the end is no preference
    assert allowed(row.unsqueeze(0), len(words))[0].nonzero().flatten().tolist() == [3]


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=256, num_kv_blocks=256)


@pytest.mark.parametrize("max_tokens", [40, pytest.param(120, marks=pytest.mark.slow)])
def test_unbounded_documents_on_random_weights_end_valid(llm, max_tokens):
    names = list(UNBOUNDED)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=UNBOUNDED[n]))
              for i, n in enumerate(names) for t in (0.0, 1.0)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        name, c = names[i // 2], out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        assert len(c.token_ids) <= max_tokens
        jsonschema.validate(json.loads(c.text), UNBOUNDED[name])


def test_without_max_tokens_the_model_length_is_the_budget(llm):
    params = SamplingParams(temperature=0.0, max_tokens=None,
                            structured_outputs=StructuredOutputsParams(json=UNBOUNDED["list"]))
    c = llm.generate("Answer in JSON:", params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop", c.text
    assert len(c.token_ids) <= 256
    jsonschema.validate(json.loads(c.text), UNBOUNDED["list"])


def test_regexes_do_not_wrap_up(llm):
    # A regex has no closers: a long match stays a match, cut by max_tokens as asked.
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{30,40}"))
    c = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length"
    assert len(c.token_ids) == 12
