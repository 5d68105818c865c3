"""``pagellm plan``: what a model needs in memory at given KV settings, without loading its weights.

The KV numbers come from the engine's own sizing (``pagellm/engine/sizing.py``, the arithmetic
``startup.allocate_kv_cache`` allocates by), the weight bytes from the checkpoint's headers (safetensors)
or tensor table (GGUF), and the suggested memory request adds a stated per-process overhead. The flags
have vLLM's names; unlike ``serve``, ``plan`` accepts settings the engine does not run yet
(``--tensor-parallel-size`` above 1, ``--kv-cache-dtype fp8``), so that a deployment can be planned for them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagellm.config import DTYPE_CHOICES, KV_CACHE_DTYPES, EngineArgs, parse_memory
from pagellm.text import plural

# Per process, besides weights and KV: the Python runtime, torch, the tokenizer, the server and a
# step's activations. Measured: 0.85 GiB of RSS for `pagellm serve` on SmolLM2-135M (float32) after a
# 1,500-token prompt, less its weights and KV pool; rounded up.
DEFAULT_OVERHEAD = "1GiB"
MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class Plan:
    """Everything ``pagellm plan`` prints; bytes are per rank where the name says so."""

    model: str
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str
    kv_element_bytes: int
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    model_max_len: int
    mean_len: int | None
    weights_source: str  # "safetensors", "gguf" or "config" (no weights in the folder: counted from the model)
    num_params: int
    weights_file_bytes: int | None
    weights_bytes: int
    weights_bytes_per_rank: int
    kv_heads_per_rank: int
    kv_bytes_per_token: int  # per rank
    kv_bytes_per_block: int  # per rank
    kv_cache_memory_per_rank: int
    num_blocks: int
    num_tokens: int
    kv_pool_bytes_per_rank: int
    max_num_seqs: int
    max_concurrency_at_max_model_len: float  # the engine's start-up log line's ratio
    max_seqs_at_max_model_len: int  # whole sequences, capped by max_num_seqs
    max_concurrency_at_mean_len: float | None
    max_seqs_at_mean_len: int | None
    swap_bytes_per_rank: int
    overhead_bytes_per_process: int
    memory_request_bytes: int
    memory_request: str  # a Kubernetes quantity (Mi)
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="memory a model needs: weights, KV blocks, concurrency, a memory request",
                       description="Size a deployment without loading the model: weight bytes (whole and per "
                                   "tensor-parallel rank), KV bytes per token and per block, the blocks a KV budget "
                                   "holds, the sequences that fit at once, and a suggested memory request.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model folder (config.json; *.safetensors if present) or .gguf file "
                        "(default: the embedded default model)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache bytes per rank (per device, as vLLM's kv_cache_memory_bytes), e.g. '8GiB' (default: "
                        "as the engine sizes it on this machine: what --max-num-seqs sequences of --max-model-len "
                        "hold, at most a fifth of the host memory available after the weights)")
    p.add_argument("--max-model-len", "--max-seq-len", dest="max_model_len", type=int, default=None,
                   help="longest sequence in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1,
                   help="ranks the attention heads and the MLP are split over")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's --dtype), fp8, fp8_e4m3 or fp8_e5m2")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto resolves as the engine does on --device (the checkpoint's; "
                        "float32 for bfloat16 on a CPU without it)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="the device --dtype auto is resolved for (auto: this machine's, as the engine would)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block, 1 to 256")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the engine's cap on sequences running at once")
    p.add_argument("--mean-len", type=int, default=None, metavar="N",
                   help="mean sequence length (prompt + output) of the workload, for a second concurrency figure")
    p.add_argument("--swap-space", type=float, default=None,
                   help="GiB of host memory per rank for swapped-out KV blocks (the engine's flag; default as the "
                        "engine sizes it on this machine: the KV cache's size, at most a tenth of the host memory "
                        "available)")
    p.add_argument("--overhead", default=DEFAULT_OVERHEAD,
                   help="memory per process besides weights, KV and swap: runtime, tokenizer, activations")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    plan = make_plan(
        args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
        device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs, mean_len=args.mean_len,
        swap_space=args.swap_space, overhead=args.overhead,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _memory(flag: str, value: Any) -> int:
    try:
        return parse_memory(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _positive(flag: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def make_plan(model: str | Path | None = None, *, kv_cache_memory: int | str | None = None,
              max_model_len: int | None = None, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
              dtype: str = "auto", device: str = "auto", block_size: int = 16, max_num_seqs: int = 256,
              mean_len: int | None = None, swap_space: float | None = None,
              overhead: int | str = DEFAULT_OVERHEAD) -> Plan:
    """The plan for ``model`` (None: the embedded default); ValueError / FileNotFoundError naming the flag."""
    # Every flag is checked before the model is read (a GGUF file's first read takes seconds).
    asked_budget = _memory("--kv-cache-memory", kv_cache_memory) if kv_cache_memory is not None else None
    overhead_bytes = _memory("--overhead", overhead)
    for flag, value in (("--max-model-len", max_model_len), ("--tensor-parallel-size", tensor_parallel_size),
                        ("--max-num-seqs", max_num_seqs), ("--mean-len", mean_len)):
        _positive(flag, value)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= 256:
        raise ValueError(f"--block-size must be an integer in [1, 256], got {block_size!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not known: use one of {', '.join(KV_CACHE_DTYPES)}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {dtype!r} is not known: use one of {', '.join(DTYPE_CHOICES)}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if swap_space is not None and (isinstance(swap_space, bool) or not isinstance(swap_space, (int, float))
                                   or not 0 <= swap_space < math.inf):
        raise ValueError(f"--swap-space must be a finite number of GiB >= 0, got {swap_space!r}")

    import torch

    from pagellm.engine import sizing, startup
    from pagellm.model import loader
    from pagellm.model.llama import head_dim_of, sliding_window_of
    from pagellm.model.registry import model_class_for
    from pagellm.worker.cpu_tuning import available_host_memory

    if model is None:
        from pagellm.model.default_model import default_model_path

        model = default_model_path()
    files = loader.resolve_model_files(model)
    config = loader.load_config(files.folder)
    model_class = model_class_for(getattr(config, "architectures", None))
    model_max_len = startup.resolve_max_model_len(config, None)
    max_len = startup.resolve_max_model_len(config, max_model_len)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    compute_dtype = loader.resolve_dtype(dtype, files.folder, target)
    dtype_name = str(compute_dtype).removeprefix("torch.")

    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if tensor_parallel_size > 1:
        from pagellm.distributed.sharding import check_shardable

        check_shardable(config, tensor_parallel_size)  # the engine's own rule: what its ranks can split
    kv = sizing.KVCacheSizing.for_model(config, block_size, compute_dtype, kv_cache_dtype, tensor_parallel_size)

    if files.gguf is not None:
        source, tensors = "gguf", sizing.gguf_tensors(files.gguf)
    else:
        try:
            source, tensors = "safetensors", sizing.safetensors_tensors(loader.safetensors_files(files.folder))
        except FileNotFoundError:
            # A folder with config.json alone (a model not downloaded yet): the parameters of transformers'
            # model for it, built on the meta device (no memory), under the names a checkpoint has.
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            source = "config"
            tensors = [sizing.WeightTensor(name, p.numel(), 0) for name, p in skeleton.named_parameters()]
    weights = sizing.WeightSizing.from_tensors(tensors, compute_dtype, num_heads, num_kv_heads, tensor_parallel_size)

    notes = []
    # What each rank of the engine would find available on this machine once its weights are loaded
    # (the ranks of a tensor-parallel engine share the host, as in startup.kv_budget_bytes).
    available = max(0, available_host_memory() // tensor_parallel_size - weights.bytes_per_rank)
    if asked_budget is not None:
        budget = asked_budget
    elif target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: give --kv-cache-memory (the engine takes 0.9 of the device's free "
                             "memory by default, and this machine has no CUDA device to measure)")
        budget = int(max(0, torch.cuda.mem_get_info()[0] - weights.bytes_per_rank) * 0.9)
        notes.append("the KV cache is sized as the engine sizes it on this machine's CUDA device: give "
                     "--kv-cache-memory to plan for another machine")
    else:
        budget = sizing.default_kv_cache_bytes(kv, max_len, max_num_seqs, available)
        notes.append(f"the KV cache is sized as the engine sizes it on this machine, {_size(available)} of host "
                     "memory available to each rank after its weights: give --kv-cache-memory to plan for another "
                     "machine")
    num_blocks = kv.num_blocks(budget)
    needed = kv.blocks_for(max_len)
    if num_blocks < needed and max_model_len is None and num_blocks > 0:
        # What the engine does at start-up: serve what the pool holds.
        notes.append(f"max_model_len {max_len} (the model's limit) does not fit the KV cache: the engine serves "
                     f"sequences of up to {plural(num_blocks * block_size, 'token')}; raise --kv-cache-memory for "
                     "longer ones")
        max_len, needed = num_blocks * block_size, num_blocks
    if num_blocks < needed:
        raise ValueError(
            f"--kv-cache-memory {kv_cache_memory or _size(budget)} holds {plural(num_blocks, 'block')} "
            f"({plural(num_blocks * block_size, 'token')}) of {plural(kv.bytes_per_block, 'byte')}, but one sequence "
            f"of max_model_len={max_len} needs {plural(needed, 'block')}: the "
            "engine would not start; raise --kv-cache-memory or lower --max-model-len")
    mean_blocks = kv.blocks_for(min(mean_len, max_len)) if mean_len is not None else None
    if mean_len is not None and mean_len > max_len:
        notes.append(f"--mean-len {mean_len} is longer than max_model_len {max_len}: counted at {max_len}")
    window = sliding_window_of(config)
    if window:
        notes.append(f"the model attends within a window of {window} tokens: where every layer does, blocks that "
                     "fall out of it go back to the pool, and long sequences hold fewer blocks than counted here")
    try:  # the engine's own rules on these settings, whatever they are when this runs
        EngineArgs(tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype)
    except ValueError as e:
        notes.append(f"pagellm serve does not run these settings yet ({e}); this plan is for them all the same")
    if tensor_parallel_size > 1:
        notes.append("per rank: embeddings, LM head and norms counted whole on every rank (an upper bound)")

    pool = num_blocks * kv.bytes_per_block
    swap_bytes = (int(swap_space * GiB) if swap_space is not None else 4 * GiB if target.type == "cuda"
                  else sizing.default_swap_bytes(pool, available))
    swap = swap_bytes // kv.bytes_per_block * kv.bytes_per_block
    request = tensor_parallel_size * (weights.bytes_per_rank + pool + swap + overhead_bytes)
    request_mib = -(-request // MiB)
    return Plan(
        model=str(files.path), architecture=model_class.__name__, num_layers=kv.num_layers,
        num_attention_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_of(config), dtype=dtype_name,
        kv_cache_dtype=kv_cache_dtype, kv_element_bytes=kv.element_bytes, tensor_parallel_size=tensor_parallel_size,
        block_size=block_size, max_model_len=max_len, model_max_len=model_max_len, mean_len=mean_len,
        weights_source=source, num_params=weights.num_params,
        weights_file_bytes=weights.file_bytes if source != "config" else None, weights_bytes=weights.bytes,
        weights_bytes_per_rank=weights.bytes_per_rank, kv_heads_per_rank=kv.num_kv_heads,
        kv_bytes_per_token=kv.bytes_per_token, kv_bytes_per_block=kv.bytes_per_block,
        kv_cache_memory_per_rank=budget, num_blocks=num_blocks, num_tokens=num_blocks * block_size,
        kv_pool_bytes_per_rank=pool, max_num_seqs=max_num_seqs,
        max_concurrency_at_max_model_len=round(num_blocks / needed, 2),
        max_seqs_at_max_model_len=min(num_blocks // needed, max_num_seqs),
        max_concurrency_at_mean_len=round(num_blocks / mean_blocks, 2) if mean_blocks else None,
        max_seqs_at_mean_len=min(num_blocks // mean_blocks, max_num_seqs) if mean_blocks else None,
        swap_bytes_per_rank=swap, overhead_bytes_per_process=overhead_bytes,
        memory_request_bytes=request_mib * MiB, memory_request=f"{request_mib}Mi", notes=notes,
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_plan(p: Plan) -> str:
    tp = p.tensor_parallel_size
    file_part = f"{_size(p.weights_file_bytes)} in the file{'s' if p.weights_source == 'safetensors' else ''}, " \
        if p.weights_file_bytes is not None else "no weight files (counted from config.json), "
    mean = (f"; {p.max_seqs_at_mean_len} at a mean length of {p.mean_len} ({p.max_concurrency_at_mean_len}x)"
            if p.mean_len is not None else "; give --mean-len N for a figure at the workload's mean length")
    lines = [
        f"model         {p.model}",
        f"              {p.architecture}: {plural(p.num_layers, 'layer')}, "
        f"{plural(p.num_attention_heads, 'attention head')}, {plural(p.num_kv_heads, 'KV head')}, "
        f"head_dim {p.head_dim}",
        f"settings      dtype {p.dtype}, kv cache dtype {p.kv_cache_dtype} "
        f"({plural(p.kv_element_bytes, 'byte')} per element), "
        f"tensor parallel {tp}, block size {p.block_size}, max_model_len {p.max_model_len} "
        f"(model limit {p.model_max_len})",
        f"weights       {p.num_params / 1e6:,.1f}M parameters; {file_part}{_size(p.weights_bytes)} in memory "
        f"({p.dtype}); {_size(p.weights_bytes_per_rank)} per rank",
        f"KV per rank   {plural(p.kv_heads_per_rank, 'KV head')}: {p.kv_bytes_per_token:,} bytes per token, "
        f"{p.kv_bytes_per_block:,} bytes per block",
        f"blocks        {p.num_blocks:,} in {_size(p.kv_cache_memory_per_rank)} per rank = {p.num_tokens:,} tokens",
        f"concurrency   {plural(p.max_seqs_at_max_model_len, 'sequence')} at max_model_len {p.max_model_len} "
        f"({p.max_concurrency_at_max_model_len}x){mean} (--max-num-seqs {p.max_num_seqs} caps both)",
        f"memory        request {p.memory_request} ({_size(p.memory_request_bytes)}) = {tp} rank{'s' if tp > 1 else ''}"
        f" x (weights {_size(p.weights_bytes_per_rank)} + KV {_size(p.kv_pool_bytes_per_rank)} + swap "
        f"{_size(p.swap_bytes_per_rank)} + overhead {_size(p.overhead_bytes_per_process)})",
    ]
    lines += [f"note          {n}" for n in p.notes]
    return "\n".join(lines)
