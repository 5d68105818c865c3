"""LLMEngine: add_request / step / abort_request, one pass down the data path per step."""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

import jinja2
import torch

from pagellm.config import EngineArgs, parse_memory
from pagellm.core.kv_cache_manager import KVCacheManager, KVCacheStats, cdiv
from pagellm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, TokenLogprobs
from pagellm.core.sequence import Request, Sequence, SequenceStatus
from pagellm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagellm.model import loader
from pagellm.model.generation_config import default_sampling_fields
from pagellm.model.llama import head_dim_of, sliding_window_of
from pagellm.model.registry import model_class_for
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.worker.cache_engine import CacheEngine, bytes_per_block
from pagellm.worker.cpu_tuning import available_host_memory, keep_freed_memory
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.sampler import Sampler

logger = logging.getLogger(__name__)


class ChatTemplateSyntaxError(ValueError):
    """A chat template that does not parse: the server's (or caller's) fault, not the messages'."""


# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict[str, Any]]

DEFAULT_CPU_KV_MEMORY = 2 * 2**30
# A tokenizer folder holds one of these (the first three are what users are told to provide; the
# last two are the files of older byte-level BPE and SentencePiece tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class StepRecord:
    """One engine step, for benchmarks: its wall time and the shape of its batch."""

    seconds: float
    num_decode_seqs: int  # sequences that computed exactly one token
    num_prefill_tokens: int  # tokens of prompts (or recomputes) computed
    context_tokens: int  # K/V entries the decodes attended over
    # The distinct ones: a block shared by several decodes (a common prefix) counted once. Its K/V is
    # read from memory once a step at least; the other sequences may find it in the cache.
    distinct_context_tokens: int = 0
    kv_blocks_in_use: int = 0
    # Where the blocks in use reach a new high (the first step at the memory report's peak is one):
    # allocated but unused slots / allocated slots, and the sequences holding blocks, after the step.
    # None elsewhere, where a pass over every sequence would add ~0.1 ms to each benchmarked step.
    kv_fragmentation: Optional[float] = None
    kv_sequences: Optional[int] = None


@dataclass
class EngineStats:
    """A snapshot of the engine's queues and KV cache, for metrics and reports. Queues count
    requests (a request with n samples is one), as vLLM's metrics do."""

    num_running: int  # requests with a sequence running
    num_waiting: int  # requests with a sequence waiting (new, or preempted by recompute) and none running
    num_swapped: int  # requests with a sequence swapped out and none running
    num_never_scheduled: int  # waiting requests not scheduled even once yet
    num_blocks: int
    num_used_blocks: int
    num_slots: int
    num_filled_slots: int  # slots holding a computed token's K/V, each physical slot once
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_generated_tokens: int  # cumulative
    num_prompt_tokens: int  # cumulative, counted when a request's prefill completes
    sla_attainment: Optional[float] = None

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def kv_cache_utilization(self) -> float:
        return self.num_filled_slots / self.num_slots


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        if args.model is None:
            from pagellm.model.default_model import default_model_path

            folder = default_model_path()
            logger.info("no model given: using the embedded default at %s", folder)
        else:
            folder = loader.check_model_folder(args.model)
        self.model_path = folder
        self.model_config = config = loader.load_config(folder)
        model_class_for(getattr(config, "architectures", None))  # fail fast, before any heavy loading
        self.device = loader.resolve_device(args.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = loader.resolve_dtype(args.dtype, folder, self.device)
        self.max_model_len = self._resolve_max_model_len(config)
        torch.manual_seed(args.seed)

        self.tokenizer = self._load_tokenizer(args.tokenizer or str(folder))
        # SamplingParams fields that requests leaving them unset take (generation_config.json's).
        self.default_sampling_fields = default_sampling_fields(args.generation_config, folder)
        if args.trust_remote_code:
            logger.info("trust_remote_code has no effect: pagellm runs no code from checkpoints, only its own "
                        "model classes")
        # Decoding several tokens at once gives the streamed text unless the tokenizer cleans up spaces
        # around punctuation ("do" "n't"), which depends on where a decoded window starts.
        self._decode_at_end_matches_stream = not getattr(self.tokenizer, "clean_up_tokenization_spaces", False)
        self.model = loader.load_model(folder, config, self.dtype, self.device, args.load_format, self.max_model_len)
        self.vocab_size = config.vocab_size

        num_layers = config.num_hidden_layers
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = head_dim_of(config)
        block_bytes = bytes_per_block(num_layers, args.block_size, num_kv_heads, head_dim, self.dtype)
        num_blocks = self._resolve_num_blocks(block_bytes)
        self.block_size = args.block_size
        needed = cdiv(self.max_model_len, args.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * args.block_size} tokens), but one sequence "
                f"of max_model_len={self.max_model_len} needs {needed} blocks: raise --kv-cache-memory or "
                f"--num-kv-blocks, or lower --max-model-len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len=%d: %.2fx",
            num_blocks, args.block_size, num_blocks * args.block_size, num_blocks * block_bytes / 2**20,
            str(self.dtype).replace("torch.", ""), self.max_model_len, num_blocks / needed,
        )
        num_cpu_blocks = int(args.swap_space * 2**30) // block_bytes
        try:
            self.cache_engine = CacheEngine(
                num_layers, num_blocks, args.block_size, num_kv_heads, head_dim, self.dtype, self.device, num_cpu_blocks
            )
        except (RuntimeError, MemoryError) as e:
            # Only the allocators' refusals (CPU: "can't allocate memory"; CUDA: OutOfMemoryError).
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "alloc" not in str(e):
                raise
            raise ValueError(
                f"cannot allocate the KV cache: {num_blocks} blocks ({num_blocks * block_bytes / 2**30:.1f} GiB) on "
                f"{self.device} and a swap pool of {num_cpu_blocks * block_bytes / 2**30:.1f} GiB: lower "
                f"--kv-cache-memory, --num-kv-blocks or --swap-space ({e})"
            ) from e
        self.kv_cache_manager = KVCacheManager(
            num_blocks, args.block_size, args.enable_prefix_caching, num_cpu_blocks=num_cpu_blocks
        )
        chunked = args.enable_chunked_prefill
        budget = args.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        )
        if budget < args.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_num_seqs ({args.max_num_seqs}): the running "
                "sequences' decodes alone could take a step's whole budget and starve every prompt; raise "
                "--max-num-batched-tokens or lower --max-num-seqs (vLLM has the same rule)"
            )
        if not chunked and budget < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({self.max_model_len}): without "
                "chunked prefill a long prompt could never be scheduled; raise --max-num-batched-tokens, lower "
                "--max-model-len or turn on --enable-chunked-prefill"
            )
        self.eos_token_ids = self._eos_token_ids(folder, config)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=chunked,
                prefill_chunk_size=args.prefill_chunk_size,
                scheduling_policy=args.scheduling_policy,
                preemption_mode=args.preemption_mode,
                default_ttft_slo=args.default_ttft_slo,
                default_tpot_slo=args.default_tpot_slo,
            ),
            self.kv_cache_manager,
            eos_token_ids=self.eos_token_ids,
        )
        sampler = Sampler(sorted(self.eos_token_ids), self.device, args.seed)
        self.model_runner = ModelRunner(
            self.model, self.cache_engine, sampler, self.device, sliding_window=sliding_window_of(config)
        )
        self.requests: dict[str, Request] = {}
        # Set to a list to record a StepRecord per step (benchmarks); None costs nothing.
        self.step_log: Optional[list[StepRecord]] = None
        self._log_high = -1  # the most blocks in use after a step of the current step log
        if args.preload_prompts:
            self.preload_prefixes(args.preload_prompts)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ------------------------------------------------------------ start-up
    def _resolve_max_model_len(self, config: Any) -> int:
        limit = getattr(config, "max_position_embeddings", None) or 2048
        asked = self.args.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(
                f"max_model_len={asked} is larger than the model's max_position_embeddings={limit}: "
                f"use --max-model-len {limit} or less"
            )
        return asked

    def _resolve_num_blocks(self, block_bytes: int) -> int:
        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        utilization = self.args.gpu_memory_utilization
        if self.args.kv_cache_memory is not None:
            budget = parse_memory(self.args.kv_cache_memory)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * (utilization if utilization is not None else 0.9))
        elif utilization is not None:
            # vLLM's flag on a CPU: a share of the host memory still available now that the model is loaded.
            available = available_host_memory()
            budget = int(available * utilization)
            logger.info("--gpu-memory-utilization %.2f of the %.1f GiB of host memory available: %.1f GiB for the "
                        "KV cache", utilization, available / 2**30, budget / 2**30)
        else:
            budget = DEFAULT_CPU_KV_MEMORY
        return budget // block_bytes

    @staticmethod
    def _load_tokenizer(path: str) -> Any:
        from transformers import AutoTokenizer

        folder = Path(path)
        if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"{path!r} has no tokenizer: none of {' / '.join(TOKENIZER_FILES[:3])} is there. Copy the model's "
                "tokenizer files into it, or give a folder that has them with --tokenizer PATH (tokenizer=... in LLM)"
            )
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # transformers raises many types; all mean the same to a user
            raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e

    def _eos_token_ids(self, folder: Path, config: Any) -> set[int]:
        ids: set[int] = set()
        gen_path = folder / "generation_config.json"
        sources: list[Any] = [getattr(config, "eos_token_id", None), self.tokenizer.eos_token_id]
        if gen_path.is_file():
            import json

            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        for s in sources:
            if isinstance(s, int):
                ids.add(s)
            elif isinstance(s, (list, tuple)):
                ids.update(int(t) for t in s)
        return ids

    # ------------------------------------------------------------- requests
    def apply_chat_template(
        self, messages: list[dict[str, Any]], chat_template: Optional[str] = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this tokenizer has no chat template: pass chat_template=... or use generate()")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except jinja2.TemplateSyntaxError as e:  # the template's fault, not the messages'
            raise ChatTemplateSyntaxError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
        except jinja2.TemplateError as e:  # the template's own refusal (raise_exception), e.g. roles not alternating
            raise ValueError(f"the chat template refused these messages: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
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
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        ttft_slo: Optional[float] = None,
        tpot_slo: Optional[float] = None,
    ) -> Request:
        """Validate and build a request without queueing it; raises ValueError on bad input.

        Touches no engine state, so a server can call it while a step runs in another thread.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        num_seqs = params.best_of or params.n
        if num_seqs > self.scheduler.config.max_num_seqs:
            raise ValueError(
                f"n/best_of={num_seqs} is more than max_num_seqs={self.scheduler.config.max_num_seqs} sequences "
                "can run at once: lower n or raise --max-num-seqs"
            )
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            # An empty salt would silently mean none: the unsalted tenants' prefixes would be shared.
            raise ValueError(f"cache_salt must be a non-empty string (or left out), got {cache_salt!r}")
        for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
            if slo is not None and (not isinstance(slo, (int, float)) or isinstance(slo, bool)
                                    or not 0 < slo < math.inf):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {slo!r}")
        self._check_vocab_params(params)
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
        for seq in request.seqs:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return request

    def check_prompt_length(self, num_tokens: int) -> None:
        """ValueError unless a prompt of ``num_tokens`` leaves room for one new token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {num_tokens} tokens long but max_model_len is {self.max_model_len} (prompt plus at "
                "least one new token must fit): shorten the prompt or raise --max-model-len"
            )

    def _check_vocab_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: token ids within the vocabulary, and
        min_tokens leaving some token to sample."""
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

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        ttft_slo: Optional[float] = None,
        tpot_slo: Optional[float] = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = self.make_request(request_id, prompt, params, arrival_time, priority, cache_salt, ttft_slo, tpot_slo)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request) -> None:
        """Queue a request built by ``make_request``."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort in any state; every block the request held is returned at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.abort_request(request)

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = self.kv_cache_manager
        running = {s.request.request_id for s in sched.running}
        swapped = {s.request.request_id for s in sched.swapped} - running
        busy = running | swapped
        waiting = {s.request for s in sched.waiting if s.request.request_id not in busy}
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_swapped=len(swapped),
            num_never_scheduled=sum(1 for r in waiting if r.metrics.first_scheduled_time is None),
            num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            num_slots=kv.num_blocks * kv.block_size,
            # Only running sequences hold device blocks (swapped ones hold CPU blocks, waiting none).
            num_filled_slots=kv.stats(list(sched.running)).physical_slots_used,
            num_preemptions=sched.stats.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_generated_tokens=sched.stats.num_generated_tokens,
            num_prompt_tokens=sched.stats.num_prompt_tokens,
            sla_attainment=sched.stats.sla_attainment,
        )

    # ----------------------------------------------------------- prefix cache
    def kv_cache_stats(self) -> KVCacheStats:
        seqs = [s for r in self.requests.values() for s in r.seqs]
        return self.kv_cache_manager.stats(seqs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (pins included); False while requests hold blocks."""
        if self.has_unfinished_requests():
            return False
        self.kv_cache_manager.unpin_all()
        return self.kv_cache_manager.reset_prefix_cache()

    def preload_prefixes(self, prompts: list[PromptType]) -> int:
        """Compute the KV of ``prompts`` now and pin their full blocks; returns the blocks pinned.

        Pinned blocks are never evicted, so later requests starting with these prompts hit the
        cache however busy the engine was in between.
        """
        if not self.kv_cache_manager.enable_prefix_caching:
            raise ValueError("preloading prefixes needs prefix caching (enable_prefix_caching=True)")
        if self.has_unfinished_requests():
            raise RuntimeError("preload prefixes before adding requests, or once the engine is idle")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        requests = [self.add_request(f"preload-{i}-{time.time_ns()}", p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished_requests():
            self.step()
        manager = self.kv_cache_manager
        pinned = 0
        for request in requests:
            seq = request.seqs[0]
            blocks = []
            for i in range(seq.num_prompt_tokens // manager.block_size):
                block = manager.pool.lookup(*manager.block_key(seq, i))
                if block is None:
                    break
                blocks.append(block)
            manager.pin(blocks)
            pinned += len(blocks)
        left = manager.num_blocks - len(manager.pinned)
        needed = cdiv(self.max_model_len, manager.block_size)
        if left < needed:
            manager.unpin_all()
            raise ValueError(
                f"the preloaded prompts pin {pinned} of {manager.num_blocks} KV blocks, leaving {left}: too few for "
                f"one sequence of max_model_len={self.max_model_len} ({needed} blocks); preload fewer prompts or "
                "raise --kv-cache-memory / --num-kv-blocks"
            )
        logger.info("preloaded %d prompt(s): %d KV blocks pinned", len(requests), pinned)
        return pinned

    def unpin_prefixes(self) -> int:
        """Release every pinned prefix (they stay cached until evicted); returns the blocks released."""
        return self.kv_cache_manager.unpin_all()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that made progress."""
        self._last_sched = None
        sched = self._last_sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                # Cannot happen while one max_model_len sequence fits the cache; guard against a silent hang.
                raise RuntimeError("scheduler made no progress with requests pending (internal error)")
            self.model_runner.sampler.forget(sched.finished_seq_ids)
            return []
        if not sched.scheduled:  # only block moves this step (a swap-in issued ahead)
            self.model_runner.execute(sched)
            return []
        t0 = time.perf_counter()
        result = self.model_runner.execute(sched)
        if self.step_log is not None:
            seconds = time.perf_counter() - t0
            decodes = [it for it in sched.scheduled if it.num_new_tokens == 1]
            context = sum(it.start + 1 for it in decodes)
            # Shared blocks are whole blocks (only full blocks are cached and shared; a forked
            # sequence copies its last block before writing to it). Tables that share a block share
            # their first one too (cached prefixes chain from the first block, forks start as their
            # parent): with every first block distinct, nothing repeats.
            repeats = 0
            if len({it.block_table[0] for it in decodes if it.block_table}) < len(decodes):
                repeats = sum(len(it.block_table) for it in decodes) - len({b for it in decodes for b in it.block_table})
            self.step_log.append(StepRecord(
                seconds=seconds,
                num_decode_seqs=len(decodes),
                num_prefill_tokens=sum(it.num_new_tokens for it in sched.scheduled) - len(decodes),
                context_tokens=context,
                distinct_context_tokens=max(0, context - repeats * self.block_size),
            ))
        touched = self.scheduler.update(sched, result)
        if self.step_log is not None:
            record = self.step_log[-1]
            record.kv_blocks_in_use = self.kv_cache_manager.pool.num_used_blocks
            if len(self.step_log) == 1:  # a new (or emptied) log
                self._log_high = -1
            if record.kv_blocks_in_use > self._log_high:
                self._log_high = record.kv_blocks_in_use
                record.kv_fragmentation = self.kv_cache_stats().internal_fragmentation
                record.kv_sequences = self.kv_cache_manager.num_sequences_with_blocks
        progressed: dict[str, Request] = {}
        for seq in touched:
            self._detokenize(seq)
            progressed[seq.request.request_id] = seq.request
        outputs = []
        for rid, request in progressed.items():
            finished = request.is_finished
            # FINAL_ONLY requests (the offline LLM's) skip building an output every step.
            if finished or request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(request))
            if finished:
                self.requests.pop(rid, None)
        return outputs

    # The schedule of the step running or last run: what a step that raised had in hand.
    _last_sched: Optional[SchedulerOutput] = None

    def last_step_request_ids(self) -> Optional[list[str]]:
        """Ids of the requests the last step worked on: scheduled, preempted, or swapped in.

        After ``step`` raised, these are the requests whose state is unknown (abort them; the rest
        of the queue is untouched). None when that is not known: the step failed before it had a
        schedule, or with no request in it.
        """
        sched = self._last_sched
        if sched is None:
            return None
        seqs = [it.seq for it in sched.scheduled] + list(sched.preempted)
        if sched.blocks_to_swap_in:  # swapped in for the next step: running, not scheduled yet
            scheduled = {id(s) for s in seqs}
            seqs += [s for s in self.scheduler.running if id(s) not in scheduled]
        return list(dict.fromkeys(s.request.request_id for s in seqs)) or None

    def _detokenize(self, seq: Sequence) -> None:
        params = seq.params
        if not params.detokenize:
            return
        if (params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings and not seq.is_finished
                and self._decode_at_end_matches_stream):
            return  # nobody reads the text before the end and no stop string needs it: decode once then
        pending = seq.output_token_ids[seq.detok.num_tokens:]
        ended_by_token = seq.status is SequenceStatus.FINISHED_STOPPED
        if ended_by_token and not params.include_stop_str_in_output:
            pending = pending[:-1]  # the EOS or stop token adds no text
            if not pending:
                return
        delta = seq.detok.add_tokens(pending)
        if seq.is_finished and not (ended_by_token and not params.include_stop_str_in_output):
            delta += seq.detok.flush()
        if not delta:
            return
        seq.text += delta
        if params.stop_strings:
            matcher = seq.detok.stop_matcher
            if matcher is None:
                matcher = seq.detok.stop_matcher = StopStringMatcher(params.stop_strings, params.stop_tables)
            # Fed every delta (before min_tokens too), so that it examines only the new text.
            hit = matcher.feed(delta)
            if hit is not None and not seq.is_finished and seq.num_output_tokens >= params.min_tokens:
                stop, idx = hit
                seq.text = seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
                seq.stop_reason = stop
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    # --------------------------------------------------------------- outputs
    def _logprobs(
        self, entries: list[Optional[TokenLogprobs]], converted: list[Any]
    ) -> list[Optional[dict[int, Logprob]]]:
        """``entries`` as Logprob dicts; ``converted`` caches earlier calls, so each entry is decoded once."""
        decode = self.tokenizer.decode
        for e in entries[len(converted):]:
            converted.append(None if e is None else {t: Logprob(lp, rank, decode([t])) for t, (lp, rank) in e.items()})
        return list(converted)

    def _make_output(self, request: Request) -> RequestOutput:
        params = request.sampling_params
        seqs = request.seqs
        if params.best_of and params.best_of > params.n and request.is_finished:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = []
        for i, seq in enumerate(seqs):
            completions.append(
                CompletionOutput(
                    index=i,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if params.scores_samples else None,
                    logprobs=(self._logprobs(seq.output_logprobs, seq.logprobs_out)  # type: ignore[arg-type]
                              if params.logprobs is not None else None),
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        m = request.metrics
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=(self._logprobs(request.prompt_logprobs, request.prompt_logprobs_out)
                             if request.wants_prompt_logprobs else None),
            outputs=completions,
            finished=request.is_finished,
            metrics=RequestMetrics(**vars(m)),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )
