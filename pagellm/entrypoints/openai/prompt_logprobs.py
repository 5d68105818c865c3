"""vLLM's ``prompt_logprobs`` request field on completions and chat, and its place in the response.

The response carries, per prompt token, ``null`` for the first (nothing comes before it) and then
``{token_id: {"logprob", "rank", "decoded_token"}}`` with the prompt's token and the ``k`` most
likely ones: on each choice of a completion, at the top level of a chat completion (as vLLM).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.outputs import PromptLogprobs

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.protocol import SamplingFields
    from pagellm.entrypoints.openai.serving import OpenAIServing

# JSON has no -inf: vLLM sends this instead (a token the model rules out).
NEG_INF_LOGPROB = -9999.0


def requested_prompt_logprobs(serving: OpenAIServing, req: SamplingFields) -> int | None:
    """How many prompt logprobs the engine computes for ``req`` (None: none); a 400 naming the field when
    it cannot be served. -1 asks for the whole vocabulary (as in vLLM), within ``--max-logprobs``."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if k < -1:
        raise APIError(400, f"prompt_logprobs must be an integer >= 0, or -1 for the whole vocabulary; got {k}",
                       param="prompt_logprobs")
    if req.stream:
        if k == 0:  # vLLM accepts 0 with a stream and sends nothing
            return None
        raise APIError(400, "prompt_logprobs are not available with stream=true: drop stream, or prompt_logprobs",
                       param="prompt_logprobs")
    if k == -1:
        k = serving.llm.vocab_size
    serving.check_logprobs("prompt_logprobs", k)
    return k


def _logprob(value: float) -> float:
    return NEG_INF_LOGPROB if value == -math.inf else value


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """The engine's prompt logprobs as the response carries them (token ids as JSON object keys)."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(token): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token, lp in entry.items()} for entry in entries]
