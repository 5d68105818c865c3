"""Input processing: checking a request and tokenizing its prompt, before it reaches the scheduler.

Touches no engine state, so a server can call it on its own thread while a step runs.
"""

from __future__ import annotations

import numbers
import time
from typing import TYPE_CHECKING, Any

import jinja2

from pagellm.config import check_slo
from pagellm.core.sequence import Request
from pagellm.sampling_params import SamplingParams
from pagellm.text import plural

if TYPE_CHECKING:
    from pagellm.structured_output import StructuredOutputManager

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = str | list[int] | dict[str, Any]


class ChatTemplateSyntaxError(ValueError):
    """A chat template that does not parse: the server's (or caller's) fault, not the messages'."""


class InputProcessor:
    """Prompts (any accepted form) and sampling settings -> a checked ``Request``; ValueError naming
    what is wrong otherwise."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 eos_token_ids: set[int], structured_output: StructuredOutputManager | None = None,
                 max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs  # -1: no limit
        self.structured_output = structured_output
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = eos_token_ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (given the ``tools`` the
        model may call, in OpenAI's form, which templates that know tools render). As in transformers:
        ``continue_final_message`` leaves the last message open for the model to go on, ``documents``
        are for templates that render them, ``template_kwargs`` are the template's own variables
        (``enable_thinking``)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this tokenizer has no chat template: pass chat_template=... or use generate()")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=True,
                continue_final_message=continue_final_message, **({"tools": tools} if tools else {}),
                **({"documents": documents} if documents else {}), **(template_kwargs or {}),
            )
        except jinja2.TemplateSyntaxError as e:  # the template's fault, not the messages'
            raise ChatTemplateSyntaxError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
        except jinja2.TemplateError as e:  # the template's own refusal (raise_exception), e.g. roles not alternating
            raise ValueError(f"the chat template refused these messages: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for any accepted prompt form; ValueError for anything else."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                # Both keys: ids already tokenized, text kept for the output (a server's echo).
                text = prompt.get("prompt")
                _, ids = self.tokenize_prompt(list(prompt["prompt_token_ids"]))
                return (text if isinstance(text, str) else None), ids
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs a 'prompt' (text) or 'prompt_token_ids' (list of ints) key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one character or token")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not ids:
                raise ValueError("the prompt is empty: give at least one token id")
            # Any integer type (numpy's too, as a tokenizer's arrays hold them), never a bool.
            bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}) for this model; got {bad[:5]}"
                )
            return None, [int(t) for t in ids]
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
    ) -> Request:
        """Validate and build a request without queueing it; raises ValueError on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        num_seqs = params.best_of or params.n
        if num_seqs > self.max_num_seqs:
            raise ValueError(
                f"n/best_of={num_seqs} is more than max_num_seqs={self.max_num_seqs} sequences "
                "can run at once: lower n or raise --max-num-seqs"
            )
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            # An empty salt would silently mean none: the unsalted tenants' prefixes would be shared.
            raise ValueError(f"cache_salt must be a non-empty string (or left out), got {cache_salt!r}")
        check_slo("ttft_slo", ttft_slo)
        check_slo("tpot_slo", tpot_slo)
        self._check_vocab_params(params)
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs is not supported by this engine")
            self.structured_output.validate(params)  # compiled now (or found compiled): errors are the caller's
        text, ids = self.tokenize_prompt(prompt)
        self.check_prompt_length(len(ids))
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
        )
        return request

    def check_prompt_length(self, num_tokens: int) -> None:
        """ValueError unless a prompt of ``num_tokens`` leaves room for one new token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {plural(num_tokens, 'token')} long but max_model_len is {self.max_model_len} (prompt "
                "plus at least one new token must fit): shorten the prompt or raise --max-model-len"
            )

    def _check_vocab_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: logprobs within --max-logprobs and the
        vocabulary, token ids within the vocabulary, and min_tokens leaving some token to sample."""
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is None:
                continue
            if 0 <= self.max_logprobs < n:
                raise ValueError(f"{name}={n} is more than this engine allows (max_logprobs {self.max_logprobs}): "
                                 f"ask for at most {self.max_logprobs}, or raise --max-logprobs (max_logprobs=... "
                                 "in LLM)")
            if n > self.vocab_size:
                raise ValueError(f"{name}={n} is more than the model's vocabulary of {self.vocab_size} tokens: ask "
                                 f"for at most {self.vocab_size}")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(f"logit_bias has token ids outside this model's vocabulary [0, {self.vocab_size}): "
                                 f"{bad[:5]}")
        if params.min_tokens:
            banned = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids)
            if len({t for t in banned if t < self.vocab_size}) >= self.vocab_size:
                raise ValueError("min_tokens bans stop_token_ids (and EOS) until it is reached, and these cover every "
                                 f"token of the vocabulary ({self.vocab_size}): nothing could be sampled; "
                                 "drop min_tokens or list fewer stop_token_ids")
