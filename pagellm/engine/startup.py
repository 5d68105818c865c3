"""Engine start-up: the model's length limit, the tokenizer and its stop tokens, and the KV cache
sized from the memory settings."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from pagellm.config import EngineArgs, parse_memory
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.kv_groups import KVCacheGroupSpec, split_kv_blocks
from pagellm.core.speculation import SpeculativeConfig
from pagellm.engine.sizing import (
    DEFAULT_KV_SHARE,
    KVCacheSizing,
    default_kv_cache_bytes,
    default_swap_bytes,
)
from pagellm.model.gemma import kv_groups_of
from pagellm.model.llama import sliding_window_of
from pagellm.worker.cache_engine import CacheEngine, kv_cache_dtype
from pagellm.worker.cpu_tuning import available_host_memory

logger = logging.getLogger("pagellm.engine.llm_engine")

CUDA_SWAP_BYTES = 4 * 2**30  # vLLM's --swap-space default

# A tokenizer folder holds one of these (the first three are what users are told to provide; the
# last two are the files of older byte-level BPE and SentencePiece tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")


def resolve_max_model_len(config: PretrainedConfig, asked: int | None) -> int:
    """``--max-model-len``, or the model's ``max_position_embeddings``; never more than the latter."""
    limit = getattr(config, "max_position_embeddings", None) or 2048
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(
            f"max_model_len={asked} is larger than the model's max_position_embeddings={limit}: "
            f"use --max-model-len {limit} or less"
        )
    return asked


def load_tokenizer(path: str) -> Any:
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


def eos_token_ids(folder: Path, config: PretrainedConfig, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id the config, the tokenizer and generation_config.json name."""
    ids: set[int] = set()
    gen_path = folder / "generation_config.json"
    sources: list[Any] = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(t) for t in s)
    return ids


def kv_budget_bytes(args: EngineArgs, device: torch.device, sizing: KVCacheSizing, max_model_len: int) -> int:
    """Bytes for the KV cache: --kv-cache-memory, else --gpu-memory-utilization of what is available
    now that the model is loaded, else on a CPU the default share of that (sizing.default_kv_cache_bytes)
    and 90% of free memory on CUDA."""
    utilization = args.gpu_memory_utilization
    if args.kv_cache_memory is not None:
        return parse_memory(args.kv_cache_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (utilization if utilization is not None else 0.9))
    # Shared by this host's tensor-parallel processes, each with a pool of its own.
    local_ranks = args.local_world_size
    available = available_host_memory() // local_ranks
    if utilization is not None:
        # vLLM's flag on a CPU: a share of the host memory still available now that the model is loaded.
        budget = int(available * utilization)
        logger.info("--gpu-memory-utilization %.2f of the %.1f GiB of host memory available: %.1f GiB for the "
                    "KV cache%s", utilization, available * local_ranks / 2**30, budget / 2**30,
                    f" of each of this host's {local_ranks} processes" if local_ranks > 1 else "")
        return budget
    budget = default_kv_cache_bytes(sizing, max_model_len, args.max_num_seqs, available)
    logger.info("KV cache sized for this machine: %.2f GiB of the %.1f GiB of host memory available (the most "
                "%d sequences of %d tokens hold, at most %d%%, but one whole sequence where it fits in half); "
                "--kv-cache-memory sets it", budget / 2**30, available / 2**30, args.max_num_seqs, max_model_len,
                round(DEFAULT_KV_SHARE * 100))
    return budget


def swap_bytes(args: EngineArgs, device: torch.device, kv_pool_bytes: int) -> int:
    """Bytes for the swap pool: --swap-space; else on a CPU as large as the KV pool, at most the default
    share of the host memory available (sizing.default_swap_bytes), and on CUDA vLLM's 4 GiB (pinned
    host memory, taken at start-up)."""
    if args.swap_space is not None:
        return int(args.swap_space * 2**30)
    if device.type == "cuda":
        return CUDA_SWAP_BYTES
    return default_swap_bytes(kv_pool_bytes, available_host_memory() // args.local_world_size)


def allocate_kv_cache(args: EngineArgs, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                      max_model_len: int, num_cpu_blocks: int | None = None
                      ) -> tuple[CacheEngine, KVCacheManager, int]:
    """The KV tensors (device pool and swap pool), the manager of their blocks, sized from the
    memory settings, and the max_model_len they serve: the model's own limit is lowered to what the
    pool holds when --max-model-len was not given (with a log line); ValueError naming the flags
    when an asked max_model_len does not fit or the allocator refuses. ``num_cpu_blocks``: the swap pool's
    size where rank 0 of a tensor-parallel engine decided it (every rank must hold the same blocks)."""
    # The same arithmetic as `pagellm plan` (engine/sizing.py). ``config`` is this rank's: under tensor
    # parallelism the model's sharded config, whose KV heads already are its share, so no split here.
    sizing = KVCacheSizing.for_model(config, args.block_size, dtype, args.kv_cache_dtype)
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    num_layers, num_kv_heads, head_dim = sizing.num_layers, sizing.num_kv_heads, sizing.head_dim
    block_bytes = sizing.bytes_per_block
    num_blocks = (args.num_kv_blocks if args.num_kv_blocks is not None
                  else kv_budget_bytes(args, device, sizing, max_model_len) // block_bytes)
    needed = cdiv(max_model_len, args.block_size)
    if num_blocks < needed and args.max_model_len is None and num_blocks > 0:
        capped = num_blocks * args.block_size
        logger.info("max_model_len %d (the model's limit) does not fit the KV cache of %d tokens: serving "
                    "sequences of up to %d tokens; raise --kv-cache-memory for longer ones", max_model_len,
                    capped, capped)
        max_model_len, needed = capped, num_blocks
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * args.block_size} tokens), but one sequence "
            f"of max_model_len={max_model_len} needs {needed} blocks: raise --kv-cache-memory or "
            f"--num-kv-blocks, or lower --max-model-len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s); max concurrency at max_model_len=%d: %.2fx",
        num_blocks, args.block_size, num_blocks * args.block_size, num_blocks * block_bytes / 2**20,
        str(kv_dtype).replace("torch.", ""), max_model_len, num_blocks / needed,
    )
    if num_cpu_blocks is None:
        num_cpu_blocks = swap_bytes(args, device, num_blocks * block_bytes) // block_bytes
    groups = kv_cache_groups(config, num_layers)
    group_blocks, group_cpu_blocks = [num_blocks], [num_cpu_blocks]
    layer_groups = [0] * num_layers
    if len(groups) > 1:
        # The same memory, split between the groups' pools (kv_groups.split_kv_blocks): every rank of a
        # tensor-parallel model computes the same split from the same block count.
        step_tokens = args.step_token_budget(max_model_len)
        group_blocks = split_kv_blocks(num_blocks, groups, args.block_size, max_model_len, args.max_num_seqs,
                                       step_tokens)
        group_cpu_blocks = split_kv_blocks(num_cpu_blocks, groups, args.block_size, max_model_len,
                                           args.max_num_seqs, step_tokens)
        for i, group in enumerate(groups):
            for layer in group.layers:
                layer_groups[layer] = i
        logger.info("KV cache groups: %s", "; ".join(
            f"{len(g.layers)} {'full-attention' if g.sliding_window is None else f'sliding ({g.sliding_window})'} "
            f"layers, {n} blocks" for g, n in zip(groups, group_blocks)))
    try:
        cache_engine = CacheEngine(
            num_layers, num_blocks, args.block_size, num_kv_heads, head_dim, kv_dtype, device, num_cpu_blocks,
            layer_groups=layer_groups, group_blocks=group_blocks, group_cpu_blocks=group_cpu_blocks,
        )
    except (RuntimeError, MemoryError) as e:
        # Only the allocators' refusals (CPU: "can't allocate memory"; CUDA: OutOfMemoryError).
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "alloc" not in str(e):
            raise
        raise ValueError(
            f"cannot allocate the KV cache: {num_blocks} blocks ({num_blocks * block_bytes / 2**30:.1f} GiB) on "
            f"{device} and a swap pool of {num_cpu_blocks * block_bytes / 2**30:.1f} GiB: lower "
            f"--kv-cache-memory, --num-kv-blocks or --swap-space ({e})"
        ) from e
    manager = KVCacheManager(group_blocks, args.block_size, args.enable_prefix_caching,
                             num_cpu_blocks=group_cpu_blocks, sliding_window=[g.sliding_window for g in groups])
    return cache_engine, manager, max_model_len


def kv_cache_groups(config: PretrainedConfig, num_layers: int) -> list[KVCacheGroupSpec]:
    """The model's KV cache groups: layers by attention kind (Gemma's full-attention and sliding layers,
    full attention first), or one group of every layer, with the model's window where every layer
    attends to one (the blocks that fall out of it go back to the pool)."""
    groups = kv_groups_of(config)
    if groups is None:
        return [KVCacheGroupSpec(tuple(range(num_layers)), sliding_window_of(config))]
    return [KVCacheGroupSpec(layers, window) for window, layers in groups]


def speculative_config(args: EngineArgs, kv_cache_manager: KVCacheManager) -> SpeculativeConfig | None:
    """``--speculative-config`` for this engine, or None; ValueError where the engine cannot speculate."""
    if args.speculative_config is None:
        return None
    assert not isinstance(args.speculative_config, str)  # (EngineArgs parsed its JSON)
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    if len(kv_cache_manager.groups) > 1:
        raise ValueError("speculative_config: models with several KV cache groups (sliding and full-attention "
                         "layers, as Gemma's) do not speculate yet; drop --speculative-config")
    if args.tensor_parallel_size > 1:
        raise ValueError("speculative_config: tensor-parallel engines do not speculate yet; drop "
                         "--speculative-config or --tensor-parallel-size")
    logger.info("speculative decoding: %s drafts of up to %d tokens (n-grams of %d to %d tokens)", spec.method,
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return spec
