"""LLMEngine: add_request / step / abort_request, one pass down the data path per step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PretrainedConfig

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheStats
from pagellm.core.kv_group_manager import blocks_per_sequence
from pagellm.core.runner_output import ModelRunnerOutput
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.core.sequence import Request
from pagellm.distributed.sharding import check_shardable, shard_for
from pagellm.distributed.tensor_parallel import TensorParallelDriver, local_device
from pagellm.engine import spec_decode, startup, tp_worker
from pagellm.engine.input_processor import ChatTemplateSyntaxError, InputProcessor, PromptType
from pagellm.engine.kv_offload import open_disk_tier, save_cached_blocks
from pagellm.engine.lora_service import LoRAService
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.phases import log_ready, phase
from pagellm.lora.request import LoRARequest
from pagellm.model import loader
from pagellm.model.generation_config import default_sampling_fields
from pagellm.model.hf_overrides import apply_hf_overrides
from pagellm.model.hub import is_hub_id, local_model_path, local_tokenizer
from pagellm.model.llama import sliding_window_of
from pagellm.model.phi3 import longrope_switch_length
from pagellm.model.registry import model_class_for
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.structured_output import StructuredOutputManager
from pagellm.text import plural
from pagellm.vllm_args import log_ignored_engine_args
from pagellm.worker.cpu_tuning import keep_freed_memory
from pagellm.worker.sampler import Sampler

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "EngineStats", "StepObserver", "PromptType", "ChatTemplateSyntaxError"]


class StepObserver(Protocol):
    """Told of every step that runs the model (benchmarks' step logs); the engine times the model
    only while one is installed."""

    def executed(self, engine: LLMEngine, scheduler_output: SchedulerOutput, seconds: float) -> None: ...

    def updated(self, engine: LLMEngine) -> None: ...


@dataclass
class EngineStats:
    """A snapshot of the engine's queues and KV cache, for metrics and reports. Queues count
    requests (a request with n samples is one), as vLLM's metrics do."""

    num_running: int  # requests with a sequence running
    num_waiting: int  # requests with a sequence waiting (new, or preempted by recompute) and none running
    num_swapped: int  # requests with a sequence swapped out and none running
    num_never_scheduled: int  # waiting requests not scheduled even once yet
    num_blocks: int  # of every KV cache group (Gemma's sliding and full-attention layers have a pool each)
    num_used_blocks: int
    num_slots: int
    num_filled_slots: int  # slots holding a computed token's K/V, each physical slot once
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_generated_tokens: int  # cumulative
    num_prompt_tokens: int  # cumulative, counted when a request's prefill completes
    sla_attainment: float | None = None
    # Speculative decoding, cumulative: sequence-steps with drafts, drafts proposed, drafts accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # The KV tier on disk (--kv-offload-dir), cumulative: blocks read back, bytes read and written, files
    # evicted past its size, reads that failed (the block recomputed).
    kv_offload_hit_blocks: int = 0
    kv_offload_read_bytes: int = 0
    kv_offload_written_bytes: int = 0
    kv_offload_evictions: int = 0
    kv_offload_failed_reads: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def kv_cache_utilization(self) -> float:
        return self.num_filled_slots / self.num_slots


class LLMEngine:
    """The engine of one model: owns the model, its KV cache (``CacheEngine`` and ``KVCacheManager``),
    the ``Scheduler``, the ``ModelRunner`` and the requests in flight (``requests``, by id).

    ``step`` is the only thing that computes: schedule, run the model, apply the samples, detokenize.
    Invariants: every request in ``requests`` is unfinished and its sequences are in exactly one of the
    scheduler's queues (or held, or a pending fork); a finished or aborted request has returned every
    block it held; the engine is not thread-safe (the server steps it from one thread, and changes its
    queues only between steps).
    """

    device: torch.device
    dtype: torch.dtype

    def __init__(self, args: EngineArgs) -> None:
        with phase("starting the engine", log=False):  # (what Ctrl-C between the phases below interrupts)
            self._start(args)
        log_ready("the engine")

    def _start(self, args: EngineArgs) -> None:
        self.args = args
        if args.model is None:
            from pagellm.model.default_model import default_model_path

            path = default_model_path()
            logger.info("no model given: using the embedded default %s", path)
        else:
            path = local_model_path(args)
        with phase("reading the model files"):
            self.model_files = files = loader.resolve_model_files(path)
        self.model_path = files.path
        with phase("reading the config and tokenizer"):
            self._read_config_and_tokenizer(args, files)
        config = self.model_config
        log_ignored_engine_args(args, from_hub=args.model is not None and is_hub_id(args.model))
        if args.trust_remote_code:
            logger.info("trust_remote_code has no effect: pagellm runs no code from checkpoints, only its own "
                        "model classes")
        # Tensor parallelism: the other ranks start loading their shares while this one loads its own.
        self.tensor_parallel: TensorParallelDriver | None = None
        world = args.tensor_parallel_size
        if args.node_rank > 0:
            raise ValueError(f"node_rank {args.node_rank}: a node other than 0 runs its model shards through "
                             "`pagellm serve ... --node-rank N`, not an engine of its own")
        if world > 1:
            check_shardable(config, world)
            self.device = local_device(self.device, 0, args)
            self.tensor_parallel = TensorParallelDriver(args, self.device, self.dtype, tp_worker.MODULE)
        try:
            self._load_and_allocate(args, files, config, world)
        except BaseException:
            self.shutdown()  # the workers must not wait for a rank 0 that will never come
            raise

    def _read_config_and_tokenizer(self, args: EngineArgs, files: loader.ModelFiles) -> None:
        folder = files.folder
        # (EngineArgs parsed the JSON of --hf-overrides and --override-generation-config into dicts.)
        assert not isinstance(args.hf_overrides, str) and not isinstance(args.override_generation_config, str)
        self.model_config = config = apply_hf_overrides(loader.load_config(folder), args.hf_overrides)
        model_class_for(getattr(config, "architectures", None))  # fail fast, before any heavy loading
        self.device = loader.resolve_device(args.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = loader.resolve_dtype(args.dtype, folder, self.device)
        self.max_model_len = startup.resolve_max_model_len(config, args.max_model_len)
        args.step_token_budget(self.max_model_len)  # its rules before any heavy loading
        torch.manual_seed(args.seed)

        self.tokenizer = startup.load_tokenizer(local_tokenizer(args) or str(files.tokenizer_folder))
        # SamplingParams fields that requests leaving them unset take (generation_config.json's).
        self.default_sampling_fields = default_sampling_fields(args.generation_config, files.generation_config_folder,
                                                               args.override_generation_config)

    def _load_and_allocate(self, args: EngineArgs, files: loader.ModelFiles, config: PretrainedConfig,
                           world: int) -> None:
        with phase("loading the weights"):
            self.model = loader.load_model(files, config, self.dtype, self.device, args.load_format,
                                           self.max_model_len, shard=shard_for(0, world),
                                           quantization=args.quantization, batch_invariant=args.batch_invariant,
                                           lora=args.enable_lora)
        self.vocab_size = config.vocab_size
        self.block_size = args.block_size
        # (model.config: under tensor parallelism, one rank's heads, what its KV pool holds)
        with phase("allocating the KV cache"):
            self.cache_engine, self.kv_cache_manager, self.max_model_len = startup.allocate_kv_cache(
                args, self.model.config, self.dtype, self.device, self.max_model_len)
        if self.tensor_parallel is not None:
            # (In blocks of every layer: each rank splits them between its KV cache groups alike.)
            self.tensor_parallel.share_kv_cache_size(self.cache_engine.num_blocks, self.max_model_len,
                                                     self.cache_engine.num_cpu_blocks)
        # A longrope model computes a sequence again when it outgrows its short factors.
        switch_length = longrope_switch_length(config, self.max_model_len)
        self.kv_cache_manager.switch_length = switch_length
        budget = args.step_token_budget(self.max_model_len)
        self.eos_token_ids = startup.eos_token_ids(files.generation_config_folder, config, self.tokenizer)
        self.speculative = spec_decode.speculative_config(args, self.kv_cache_manager)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
                prefill_chunk_size=args.prefill_chunk_size,
                scheduling_policy=args.scheduling_policy,
                preemption_mode=args.preemption_mode,
                default_ttft_slo=args.default_ttft_slo,
                default_tpot_slo=args.default_tpot_slo,
                recompute_past_length=switch_length,
                speculative=self.speculative,
                max_loras=args.max_loras if args.enable_lora else None,
            ),
            self.kv_cache_manager,
            eos_token_ids=self.eos_token_ids,
        )
        sampler = Sampler(sorted(self.eos_token_ids), self.device, args.seed)
        # Constrained decoding; the grammar engine loads with the first constrained request.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                         self.max_model_len, limits=args.constraint_limits)
        with phase("preparing the model runner"):
            self.model_runner = spec_decode.model_runner(
                self.speculative, args, self.model, self.cache_engine, sampler, self.device, self.dtype, self.tokenizer,
                self.max_model_len, sliding_window=sliding_window_of(config), structured_output=self.structured_output,
                calculate_kv_scales=args.calculate_kv_scales)
        self.lora = LoRAService(args, self.model_runner, self.dtype, self.device) if args.enable_lora else None
        if args.kv_offload_dir is not None:
            with phase("opening the KV tier on disk"):
                self.model_runner.disk_store = open_disk_tier(args, files, config, self.dtype,
                                                              self.kv_cache_manager, self.cache_engine)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, args.max_num_seqs,
                                              self.eos_token_ids, structured_output=self.structured_output,
                                              max_logprobs=args.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_seq)
        self.requests: dict[str, Request] = {}
        self.step_observers: list[StepObserver] = []
        # The schedule of the step running or last run: what a step that raised had in hand.
        self._last_scheduler_output: SchedulerOutput | None = None
        if args.preload_prompts:
            assert not isinstance(args.preload_prompts, str)  # EngineArgs read the file into a list
            self.preload_prefixes(args.preload_prompts)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ------------------------------------------------------------- requests
    def apply_chat_template(
        self, messages: list[dict[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **options: Any,
    ) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (with ``tools``, OpenAI's
        function definitions, where the template renders them); ``options``: ``continue_final_message``,
        ``documents``, ``template_kwargs`` (``InputProcessor.apply_chat_template``)."""
        return self.input_processor.apply_chat_template(messages, chat_template, add_generation_prompt, tools,
                                                        **options)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for any accepted prompt form; ValueError for anything else."""
        return self.input_processor.tokenize_prompt(prompt)

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                     ttft_slo: float | None = None, tpot_slo: float | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and build a request without queueing it; raises ValueError on bad input.

        Touches no engine state, so a server can call it while a step runs in another thread.
        """
        request = self.input_processor.make_request(request_id, prompt, params, arrival_time, priority, cache_salt,
                                                    ttft_slo, tpot_slo)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} requested, but "
                                 "the engine was started without LoRA: pass enable_lora=True (--enable-lora)")
            request.lora_request = self.lora.check(lora_request)
        return request

    def check_prompt_length(self, num_tokens: int) -> None:
        """ValueError unless a prompt of ``num_tokens`` leaves room for one new token."""
        self.input_processor.check_prompt_length(num_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = self.make_request(request_id, prompt, params, arrival_time, priority, cache_salt, ttft_slo, tpot_slo,
                                    lora_request)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request) -> None:
        """Queue a request built by ``make_request``."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort in any state; every block the request held is returned at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.abort_request(request)

    def get_stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = self.kv_cache_manager
        running = {s.request.request_id for s in scheduler.running}
        swapped = {s.request.request_id for s in scheduler.swapped} - running
        busy = running | swapped
        waiting = {s.request for s in scheduler.waiting if s.request.request_id not in busy}
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_swapped=len(swapped),
            num_never_scheduled=sum(1 for r in waiting if r.metrics.first_scheduled_time is None),
            num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            num_slots=kv.num_blocks * kv.block_size,
            # Only running sequences hold device blocks (swapped ones hold CPU blocks, waiting none).
            num_filled_slots=kv.stats(list(scheduler.running)).physical_slots_used,
            num_preemptions=scheduler.stats.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_generated_tokens=scheduler.stats.num_generated_tokens,
            num_prompt_tokens=scheduler.stats.num_prompt_tokens,
            sla_attainment=scheduler.stats.sla_attainment,
            spec_decode_num_drafts=scheduler.stats.num_spec_drafts,
            spec_decode_num_draft_tokens=scheduler.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler.stats.num_accepted_tokens,
            **self._disk_tier_stats(),
        )

    def _disk_tier_stats(self) -> dict[str, int]:
        index, store = self.kv_cache_manager.disk, self.model_runner.disk_store
        if index is None or store is None:
            return {}
        return {"kv_offload_hit_blocks": index.hit_blocks, "kv_offload_read_bytes": store.bytes_read,
                "kv_offload_written_bytes": store.bytes_written, "kv_offload_evictions": index.evicted_files,
                "kv_offload_failed_reads": index.failed_reads}

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

    def preload_prefixes(self, prompts: Iterable[PromptType]) -> int:
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
        pinned = sum(manager.pin_prompt(request.seqs[0]) for request in requests)
        # Every group must keep room for one sequence of max_model_len (a sliding group, for its window).
        left, needed = min(((g.num_blocks - len(g.pinned),
                             blocks_per_sequence(self.max_model_len, g.block_size, g.sliding_window))
                            for g in manager.groups), key=lambda x: x[0] - x[1])
        if left < needed:
            manager.unpin_all()
            raise ValueError(
                f"the preloaded prompts pin {pinned} of {manager.num_blocks} KV blocks, leaving {left}: too few for "
                f"one sequence of max_model_len={self.max_model_len} ({needed} blocks); preload fewer prompts or "
                "raise --kv-cache-memory / --num-kv-blocks"
            )
        if manager.save_pinned():
            self.step()  # (a step of block moves only: the pinned blocks are written to the disk tier)
        logger.info("preloaded %s: %s pinned", plural(len(requests), "prompt"), plural(pinned, "KV block"))
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
        """Schedule, execute, update, and make outputs: one for every request that made progress."""
        self._last_scheduler_output = None
        scheduler_output = self._last_scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_unfinished():
                # Cannot happen while one max_model_len sequence fits the cache; guard against a silent hang.
                raise RuntimeError("scheduler made no progress with requests pending (internal error)")
            if scheduler_output.finished_seq_ids:  # the runner (every rank's) drops their state
                self.execute_model(scheduler_output)
            return []
        if not scheduler_output.scheduled:  # only block moves this step (a swap-in or a disk read issued ahead)
            self.scheduler.update(scheduler_output, self.execute_model(scheduler_output))
            return []
        result = self._execute(scheduler_output)
        self.output_processor.add_prompt_logprobs(result, self.scheduler.seqs_by_id)
        touched = self.scheduler.update(scheduler_output, result)
        for observer in self.step_observers:
            observer.updated(self)
        for seq in touched:
            self.output_processor.detokenize(seq)
        return self._make_outputs(dict.fromkeys(seq.request for seq in touched))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The model runner's step; under tensor parallelism, sent to every rank first."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.execute(self.model_runner, scheduler_output)
        return self.model_runner.execute(scheduler_output)

    def shutdown(self) -> None:
        """Stop the grammar probe and the tensor-parallel workers, if any (the engine computes no step
        after this)."""
        if hasattr(self, "structured_output"):  # (not when the engine failed while starting)
            self.structured_output.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        runner = getattr(self, "model_runner", None)
        if runner is not None and runner.disk_store is not None:
            try:
                save_cached_blocks(self.kv_cache_manager, runner.disk_store)
            except Exception as e:  # (stopping goes on: those blocks are recomputed next time)
                logger.warning("KV tier on disk: could not write the cached blocks: %s: %s", type(e).__name__, e)
            runner.disk_store.close()  # (the writes queued finish first)
            runner.disk_store = None

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.step_observers:
            return self.execute_model(scheduler_output)
        t0 = time.perf_counter()
        result = self.execute_model(scheduler_output)
        seconds = time.perf_counter() - t0
        for observer in self.step_observers:
            observer.executed(self, scheduler_output, seconds)
        return result

    def _make_outputs(self, progressed: Iterable[Request]) -> list[RequestOutput]:
        outputs = []
        for request in progressed:
            finished = request.is_finished
            # FINAL_ONLY requests (the offline LLM's) skip building an output every step.
            if finished or request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self.output_processor.make_output(request))
            if finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def last_step_request_ids(self) -> list[str] | None:
        """Ids of the requests the last step worked on: scheduled, preempted, or swapped in.

        After ``step`` raised, these are the requests whose state is unknown (abort them; the rest
        of the queue is untouched). None when that is not known: the step failed before it had a
        schedule, or with no request in it.
        """
        scheduler_output = self._last_scheduler_output
        if scheduler_output is None:
            return None
        by_id = self.scheduler.seqs_by_id
        ids = [it.seq_id for it in scheduler_output.scheduled] + scheduler_output.preempted_seq_ids
        seqs = [by_id[i] for i in ids if i in by_id]
        if scheduler_output.swaps_in:  # swapped in for the next step: running, not scheduled yet
            scheduled = {id(s) for s in seqs}
            seqs += [s for s in self.scheduler.running if id(s) not in scheduled]
        return list(dict.fromkeys(s.request.request_id for s in seqs)) or None

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output as it stands (an aborted one's, say)."""
        return self.output_processor.make_output(request)

