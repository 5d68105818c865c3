"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Bodies are strict: a wrong type or an unknown field is a 400 that names it. Fields
OpenAI defines but this server does not implement are declared, so that the
refusal can say "not supported" rather than "unknown".
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagellm.sampling_params import SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by completions and chat, vLLM's extensions included."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: Optional[str] = None
    ttft_slo: Optional[float] = None  # seconds, for --scheduling-policy sla
    tpot_slo: Optional[float] = None

    def sampling_params(self, max_tokens: Optional[int], **extra: Any) -> SamplingParams:
        """Raises ValueError naming the field on an invalid value."""
        bias = None
        if self.logit_bias:
            # Plain ASCII digits only: int() would also take " 5", "1_0", "-1" and other scripts' digits.
            bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids written as non-negative integers "
                                 f"(\"42\"), got {bad[:5]}")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **{k: v for k, v in optional.items() if v is not None},
            **extra,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    # Content parts other than text (images, audio) are refused by the handler with a clear message.
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


UNSUPPORTED_CHAT_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                           "audio", "modalities", "prediction", "web_search_options")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    # Declared only to be refused by name.
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None

    def unsupported_field(self) -> Optional[str]:
        for name in UNSUPPORTED_CHAT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "tool_choice" and value == "none"):
                return name
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        return None


class TokenizeRequest(StrictModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: list[int]
