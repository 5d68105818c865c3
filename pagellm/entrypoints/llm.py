"""The offline ``LLM`` class: batch generation as vLLM users know it."""

from __future__ import annotations

import itertools
import numbers
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm.auto import tqdm

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheStats
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.engine.pooling_engine import PoolingEngine
from pagellm.engine.runner_choice import pooling_task
from pagellm.entrypoints.pooling_api import PoolingAPI
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.text import plural

Message = dict[str, Any]


def _as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral)
    ):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be one prompt (a string, a list of token ids or a dict) or a list of them, "
                        f"not {type(prompts).__name__}")
    return list(prompts)


class LLM(PoolingAPI):
    """``LLM(model=None, **engine_args)``: with no model, the embedded tiny default. An encoder's folder
    (or ``runner="pooling"``) loads the pooling engine: ``embed``, ``encode``, ``classify``, ``score``."""

    llm_engine: Any  # LLMEngine, or PoolingEngine under runner="pooling"

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        task = pooling_task(args)
        self.llm_engine = LLMEngine(args) if task is None else PoolingEngine(args, task)
        self._counter = itertools.count()
        # The engine's processes (tensor-parallel workers, the grammar probe) end with this object:
        # ``del llm; gc.collect()`` frees them for the next LLM, as in vLLM; so does ``with LLM(...)``.
        self._shutdown = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (the LLM computes nothing after this)."""
        self._shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _generative(self, method: str) -> None:
        if isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(f"LLM.{method} generates text, but this model was loaded with runner='pooling' "
                             "(an encoder embeds or scores): use LLM.embed, encode, classify or score")

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams: the model's
        generation_config.json values (``generation_config="auto"``), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.default_sampling_fields)

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt; each output holds the ``beam_width`` best sequences, best first."""
        self._generative("beam_search")
        return beam_search(self.llm_engine, _as_prompt_list(prompts), params)

    # ------------------------------------------------------------ KV cache
    def kv_cache_stats(self) -> KVCacheStats:
        """Blocks (total, free, in use, cached, pinned), tokens vs. slots, sharing savings,
        internal fragmentation and prefix-cache queries/hits."""
        return self.llm_engine.kv_cache_stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def preload_prefixes(self, prompts: Seq[PromptType]) -> int:
        """Compute and pin the KV of common prompts (system prompts); returns the blocks pinned."""
        return self.llm_engine.preload_prefixes(list(prompts))

    def unpin_prefixes(self) -> int:
        return self.llm_engine.unpin_prefixes()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. Give one SamplingParams for all or one per prompt;
        ``priority`` (one per prompt, lower first) matters with ``scheduling_policy="priority"``;
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's.
        """
        self._generative("generate")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                    isinstance(p, SamplingParams) for p in sampling_params):
                raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt), not "
                                f"{type(sampling_params).__name__}")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {plural(len(prompts), 'prompt')}: give one, or one "
                    "per prompt"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {plural(len(priorities), 'priority', 'priorities')} for "
                             f"{plural(len(prompts), 'prompt')}: give one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {plural(len(prompts), 'prompt')}: give one, or "
                                 "one per prompt")
        return self._run(prompts, params_list, use_tqdm, priorities, loras)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template
        (given ``tools``, OpenAI's function definitions, where the template renders them). As in vLLM,
        ``continue_final_message`` leaves the last message open for the reply to continue, and
        ``chat_template_kwargs`` are the template's own variables (``{"enable_thinking": False}``). Each
        output's ``prompt`` is the rendered conversation, as in vLLM."""
        self._generative("chat")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: pass "
                             "add_generation_prompt=False to continue the last message")
        conversations = cast("list[list[Message]]",
                             [messages] if messages and isinstance(messages[0], dict) else messages)
        prompts: list[PromptType] = []
        for conv in conversations:
            ids = self.llm_engine.apply_chat_template(conv, chat_template, add_generation_prompt, tools,
                                                      continue_final_message=continue_final_message,
                                                      template_kwargs=chat_template_kwargs)
            text = self.llm_engine.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool | Callable[..., Any],
             priorities: list[int] | None = None, loras: list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, prio, lora in zip(ids, prompts, params, priorities or [0] * len(ids),
                                                  loras or [None] * len(ids)):
                # Only final outputs are returned: the engine need not build one every step.
                engine.add_request(rid, prompt, p.clone(output_kind=RequestOutputKind.FINAL_ONLY), priority=prio,
                                   lora_request=lora)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # a bad prompt queues nothing of its batch
            raise
        finished: dict[str, RequestOutput] = {}
        # use_tqdm may be a tqdm-like factory (vLLM's convention), called with tqdm's arguments.
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in ids:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(added)  # interrupted: free every block of this batch
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]
