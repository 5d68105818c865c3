"""Reasoning parsers: the thinking and the answer of a final text, and streams that add up to it."""

from __future__ import annotations

import pytest

from pagellm.entrypoints.openai.reasoning_parsers import PromptThinking, get_reasoning_parser

CASES = [
    # (parser, what the prompt did, output, thinking, answer)
    ("qwen3", PromptThinking.NONE, "<think>\nLet me add: 2 + 2.\n</think>\n\nIt is 4.", "\nLet me add: 2 + 2.\n",
     "It is 4."),
    ("qwen3", PromptThinking.NONE, "It is 4.", "", "It is 4."),  # no thinking written
    ("qwen3", PromptThinking.OPENED, "2 + 2 is 4.</think>It is 4.", "2 + 2 is 4.", "It is 4."),
    ("qwen3", PromptThinking.CLOSED, "It is 4. <think>no</think>", "", "It is 4. <think>no</think>"),
    ("deepseek_r1", PromptThinking.NONE, "2 + 2 is 4.\n</think>\n\nIt is 4.", "2 + 2 is 4.\n", "It is 4."),
    ("deepseek_r1", PromptThinking.NONE, "<think>2 + 2 is 4.</think>It is 4.", "2 + 2 is 4.", "It is 4."),
    ("think", PromptThinking.NONE, "<think>hm</think>ok", "hm", "ok"),
    ("think", PromptThinking.NONE, "<think>cut off while thinking", "cut off while thinking", ""),
]


@pytest.mark.parametrize(("name", "prompt", "text", "thinking", "answer"), CASES)
def test_final_split(name, prompt, text, thinking, answer):
    split = get_reasoning_parser(name).split(text, final=True, prompt=prompt)
    assert (split.reasoning, split.content) == (thinking, answer)


@pytest.mark.parametrize(("name", "prompt", "text", "thinking", "answer"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streams_only_extend_and_add_up(name, prompt, text, thinking, answer, step):
    parser = get_reasoning_parser(name)
    seen_reasoning, seen_content = "", ""
    for end in range(step, len(text) + step, step):
        split = parser.split(text[:end], final=end >= len(text), prompt=prompt)
        assert split.reasoning.startswith(seen_reasoning) and split.content.startswith(seen_content)
        seen_reasoning, seen_content = split.reasoning, split.content
        assert "</think>" not in split.reasoning and not split.content.startswith("<think")
    assert (seen_reasoning, seen_content) == (thinking, answer)


def test_the_prompt_tells_what_it_did_and_unknown_parsers_are_named():
    assert PromptThinking.of("<|im_start|>assistant\n<think>\n") is PromptThinking.OPENED
    assert PromptThinking.of("<|im_start|>assistant\n<think>\n\n</think>\n\n") is PromptThinking.CLOSED
    assert PromptThinking.of("<|im_start|>assistant\n") is PromptThinking.NONE
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*deepseek_r1"):
        get_reasoning_parser("r2")
