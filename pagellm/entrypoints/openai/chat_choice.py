"""What one chat choice's output text becomes in the API: its thinking, then its answer's content and
tool calls.

The reasoning parser (``--reasoning-parser``) splits off the thinking first, which goes to
``reasoning_content`` and to vLLM's newer ``reasoning`` (unless ``include_reasoning`` is false); the
tool mode then reads the answer into content and tool calls. The stream and the final message read
the same text the same way, so a stream's deltas add up to the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.reasoning_parsers import PromptThinking, ReasoningParser
from pagellm.entrypoints.openai.tool_calling import ToolCallStream, ToolMode, message_tool_calls


@dataclass
class ChatChoiceReader:
    """Reads one choice's output (the whole text so far, each time) into deltas or a message."""

    mode: ToolMode
    reasoning: ReasoningParser | None = None
    prompt_thinking: PromptThinking = PromptThinking.NONE
    include_reasoning: bool = True
    reasoning_sent: int = 0
    answer: ToolCallStream = field(init=False)

    def __post_init__(self) -> None:
        self.answer = ToolCallStream(self.mode)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(the thinking, the answer) of ``text``."""
        if self.reasoning is None:
            return "", text
        split = self.reasoning.split(text, final, self.prompt_thinking)
        return split.reasoning, split.content

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas that bring the client from what it has to ``text``."""
        thinking, answer = self._split(text, final)
        out: list[dict[str, Any]] = []
        if self.include_reasoning and len(thinking) > self.reasoning_sent:
            piece = thinking[self.reasoning_sent:]
            self.reasoning_sent = len(thinking)
            out.append({"reasoning_content": piece, "reasoning": piece})
        return out + self.answer.deltas(answer, final)

    @property
    def called(self) -> bool:
        """Whether the stream sent a tool call."""
        return self.answer.called

    def message(self, text: str, role: str) -> tuple[dict[str, Any], bool]:
        """The final message of ``text``, and whether it calls tools."""
        thinking, answer = self._split(text, final=True)
        message: dict[str, Any] = {"role": role, "content": answer}
        called = False
        if self.mode.kind != "none":
            parsed = self.mode.parse(answer, final=True)
            if parsed.tools_called:
                message = {"role": role, "content": parsed.content or None, "tool_calls": message_tool_calls(parsed)}
                called = True
        if self.reasoning is not None:
            shown = thinking if self.include_reasoning and thinking else None
            message["reasoning_content"] = message["reasoning"] = shown
        return message, called
