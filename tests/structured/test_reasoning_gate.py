"""A reasoning model's constraint holds only after its thinking, and a thinking budget ends the
thinking (reasoning_gate.py), through the offline LLM on a random-weight model."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.structured_output.reasoning_gate import ReasoningGate, find_end

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), max_model_len=256, num_kv_blocks=64)


def marker_of(llm: LLM) -> list[int]:
    """Two ordinary tokens standing in for ``</think>`` (a random model writes them by chance only)."""
    return llm.get_tokenizer().encode(" paged memory", add_special_tokens=False)[:2]


def test_the_budget_ends_the_thinking_and_the_constraint_holds_what_follows(llm):
    marker = marker_of(llm)
    assert len(marker) == 2
    free = llm.generate(["Think:"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=40, reasoning_end_token_ids=marker, thinking_token_budget=5,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    (out,) = llm.generate(["Think:"], params, use_tqdm=False)[0].outputs
    tokens = list(out.token_ids)
    # The first five tokens are the model's own (what it writes unconstrained), then the forced end.
    assert tokens[:5] == list(free[:5]) and tokens[5:7] == marker
    answer = llm.get_tokenizer().decode(tokens[7:], skip_special_tokens=True)
    assert answer in CHOICES and out.finish_reason == "stop"


def test_without_a_budget_the_constraint_waits_for_the_end_of_thinking(llm):
    marker = marker_of(llm)
    free = llm.generate(["Think:"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, reasoning_end_token_ids=marker,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    (out,) = llm.generate(["Think:"], params, use_tqdm=False)[0].outputs
    assert find_end(list(free), marker, 0) is None  # the model never ends its thinking here...
    assert list(out.token_ids) == list(free)  # ...so the choice never holds it: every token is its own


def test_a_budget_alone_forces_the_end_and_then_frees_the_output(llm):
    marker = marker_of(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, reasoning_end_token_ids=marker,
                            thinking_token_budget=0)
    (out,) = llm.generate(["Think:"], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    assert tokens[:2] == marker
    # The rest is the model's own continuation of the prompt and the forced end.
    after = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (rest,) = llm.generate([{"prompt_token_ids": list(out.prompt_token_ids) + marker}], after, use_tqdm=False)
    assert tokens[2:] == list(rest.outputs[0].token_ids)


def test_the_gate_finds_the_end_once_and_follows_a_rollback():
    class Seq:
        seq_id = 1
        params = SamplingParams(reasoning_end_token_ids=[7, 8], thinking_token_budget=3)
        output_token_ids = [1, 2]

    gate, seq = ReasoningGate(), Seq()
    assert gate.end_of(seq) is None and gate.forced_token(seq) is None
    seq.output_token_ids = [1, 2, 3]
    assert gate.forced_token(seq) == 7
    seq.output_token_ids = [1, 2, 3, 7]
    assert gate.end_of(seq) is None and gate.forced_token(seq) == 8
    seq.output_token_ids = [1, 2, 3, 7, 8, 9]
    assert gate.end_of(seq) == 5
    seq.output_token_ids = [1, 2, 3, 7]  # rolled back past the end
    assert gate.end_of(seq) is None
