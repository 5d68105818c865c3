"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Bodies are strict: a wrong type is a 400 that names it. ``tolerance.relax`` reads a body first as vLLM
does (null is unset, ``4.0`` is 4, unknown fields are dropped with a warning, or kept for the models
to refuse under ``--strict-requests``). Fields that OpenAI or vLLM define fall in three groups:
implemented; accepted and ignored, as they do not change what is generated (``IGNORED``); declared
only to be refused by name, as they would change the output and are not implemented (``REFUSED``),
unless given the value that changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.server")

# Ignored field names already logged: once each, not once per request.
_logged_ignored: set[str] = set()


def note_ignored(name: str) -> None:
    if name not in _logged_ignored:
        _logged_ignored.add(name)
        logger.debug("the request field '%s' does not change what is generated here: accepted and ignored", name)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's: usage (so far) on every chunk too; with include_usage only, as in vLLM.
    continuous_usage_stats: bool = False
    # OpenAI's: random padding against length side channels; these streams carry none.
    include_obfuscation: bool | None = None

    IGNORED: ClassVar[tuple[str, ...]] = ("include_obfuscation",)


class SamplingFields(StrictModel):
    """Fields shared by completions and chat, vLLM's extensions included."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams
    # Accepted and ignored (IGNORED).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    length_penalty: float | None = None  # vLLM's, for beam search only
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    ttft_slo: float | None = None  # seconds, for --scheduling-policy sla
    tpot_slo: float | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the prompt's last N tokens
    # vLLM's: beam search (serving_beam_search.py) and the prompt's logprobs (prompt_logprobs.py).
    use_beam_search: bool | None = None
    prompt_logprobs: int | None = None
    # vLLM's, declared only to be refused by name (REFUSED).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's older names of structured_outputs' fields.
    guided_json: Any | None = None
    guided_regex: Any | None = None
    guided_choice: Any | None = None
    guided_grammar: Any | None = None
    structural_tag: Any | None = None
    logits_processors: Any | None = None
    return_tokens_as_token_ids: bool | None = None

    IGNORED: ClassVar[tuple[str, ...]] = ("user", "store", "metadata", "service_tier", "prompt_cache_key",
                                          "safety_identifier", "length_penalty")
    # name -> the values (besides null) that change nothing, and so are accepted.
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "allowed_token_ids": (), "bad_words": ([],),
        "structural_tag": (),
        "logits_processors": ([],), "return_tokens_as_token_ids": (False,),
    }

    @model_validator(mode="after")
    def _note_ignored_fields(self) -> SamplingFields:
        for name in self.IGNORED:
            if name in self.model_fields_set and not (name == "length_penalty" and self.use_beam_search):
                note_ignored(name)
        if self.stream_options is not None:
            for name in StreamOptions.IGNORED:
                if name in self.stream_options.model_fields_set:
                    note_ignored(f"stream_options.{name}")
        return self

    def unsupported_field(self) -> str | None:
        """The first field given that would change the output but is not implemented here."""
        for name, noops in self.REFUSED.items():
            value = getattr(self, name)
            if value is not None and not any(type(value) is type(v) and value == v for v in noops):
                return name
        return None

    def sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None,
                        **extra: Any) -> SamplingParams:
        """Raises ValueError naming the field on an invalid value. ``defaults`` (the model's
        generation_config.json values) fill the sampling fields the request leaves unset."""
        bias = None
        if self.logit_bias:
            # Plain ASCII digits only: int() would also take " 5", "1_0", "-1" and other scripts' digits.
            bad = [k for k in self.logit_bias if not (k.isascii() and k.isdigit())]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids written as non-negative integers "
                                 f"(\"42\"), got {bad[:5]}")
            # (No vocabulary is that large: and int() of 4,300 digits or more raises its own error.)
            long = [k for k in self.logit_bias if len(k) > 12]
            if long:
                raise ValueError(f"logit_bias keys must be token ids in the model's vocabulary, got a key of "
                                 f"{len(long[0])} digits ({long[0][:12]}...)")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        optional = {k: v if v is not None else (defaults or {}).get(k) for k, v in given.items()}
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
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            **{k: v for k, v in optional.items() if v is not None},
            **extra,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: vLLM's ``continuous_usage_stats``, which needs ``include_usage``."""
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: False tokenizes a text prompt without BOS and the like


class ChatMessage(BaseModel):
    # Content parts other than text (images, audio) are refused by the handler with a clear message.
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the older tool
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant's calls ({"id", "type": "function", "function": {"name", "arguments"}}), and the
    # call a tool message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # What the API returns on an assistant message, so that a history replayed from a client's
    # objects (the openai SDK's message.model_dump()) carries it.
    refusal: str | None = None  # ignored: the content says what the model said
    annotations: list[Any] | None = None  # ignored: citations of the answer
    audio: dict[str, Any] | None = None  # an earlier audio answer: refused unless null
    function_call: dict[str, Any] | None = None  # the deprecated single call: read as tool_calls
    reasoning_content: str | None = None  # earlier thinking, for the templates that show it
    reasoning: str | None = None  # vLLM's newer name of reasoning_content


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments always match the schema here, strict or not


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a named function
    parallel_tool_calls: bool | None = None  # False: at most one call
    # With --reasoning-parser: false drops the thinking from the reply; the budget (vLLM's name, or
    # max_reasoning_tokens) ends the thinking after that many tokens.
    include_reasoning: bool | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0)
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    # Declared only to be refused by name (REFUSED).
    functions: Any | None = None
    function_call: Any | None = None
    audio: Any | None = None
    modalities: Any | None = None
    prediction: Any | None = None
    web_search_options: Any | None = None
    verbosity: Any | None = None
    # vLLM's chat extensions that change the prompt: the template's arguments (chat_prompt.py).
    continue_final_message: bool = False  # the reply continues the last message (add_generation_prompt false)
    documents: list[dict[str, Any]] | None = None  # for templates that render retrieved documents
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking)
    reasoning_effort: str | None = None  # as vLLM: a variable of the template (gpt-oss's reads it)
    # Declared only to be refused by name (REFUSED).
    echo: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingFields.REFUSED,
        "functions": ([],), "function_call": ("none",), "audio": (),
        "modalities": (["text"],), "prediction": (), "web_search_options": (), "verbosity": (),
        "echo": (False,), "add_special_tokens": (False,), "chat_template": (),
    }


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
