"""Speculative decoding at start-up: ``--speculative-config`` checked against the engine, and the model
runner that goes with it (a draft model loaded beside the target, with its KV pools: worker/draft_model.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.speculation import SpeculativeConfig
from pagellm.engine import startup
from pagellm.engine.phases import phase
from pagellm.engine.sizing import KVCacheSizing
from pagellm.model import loader
from pagellm.model.gemma import kv_groups_of
from pagellm.model.hub import HubSettings, download_model, is_hub_id
from pagellm.model.llama import sliding_window_of
from pagellm.model.registry import model_class_for
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.draft_model import DraftModelRunner, check_draft_vocabulary
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.sampler import Sampler

logger = logging.getLogger(__name__)


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
    if spec.uses_draft_model:
        if args.kv_offload_dir is not None:
            raise ValueError("speculative_config: a draft model does not combine with --kv-offload-dir (the files "
                             "hold the target's K/V, not the draft's); drop one of them, or use the ngram method")
        if kv_cache_manager.switch_length is not None:
            raise ValueError("speculative_config: a longrope model (Phi-3's long contexts) proposes no drafts; "
                             "drop --speculative-config")
        logger.info("speculative decoding: drafts of up to %d tokens from the draft model %s",
                    spec.num_speculative_tokens, spec.model)
    else:
        logger.info("speculative decoding: %s drafts of up to %d tokens (n-grams of %d to %d tokens)", spec.method,
                    spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return spec


def model_runner(spec: SpeculativeConfig | None, args: EngineArgs, model: Any, cache_engine: CacheEngine,
                 sampler: Sampler, device: torch.device, dtype: torch.dtype, tokenizer: Any, max_model_len: int,
                 **kwargs: Any) -> ModelRunner:
    """The engine's model runner: with a draft model, one that drafts with it (loaded here, its KV pools
    as many blocks as the target's); ``kwargs``: ``ModelRunner``'s."""
    if spec is None or not spec.uses_draft_model:
        return ModelRunner(model, cache_engine, sampler, device, speculative=spec is not None, **kwargs)
    assert spec.model is not None
    with phase("loading the draft model"):
        path = download_model(spec.model, HubSettings(spec.revision, args.download_dir, args.hf_token, None)) \
            if is_hub_id(spec.model) and not Path(spec.model).exists() else Path(spec.model)
        try:
            files = loader.resolve_model_files(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} cannot be read: {e}") from e
        config = loader.load_config(files.folder)
        model_class_for(getattr(config, "architectures", None))
        check_draft_vocabulary(tokenizer, startup.load_tokenizer(str(files.tokenizer_folder)), spec.model)
        if kv_groups_of(config) is not None or sliding_window_of(config) != kwargs.get("sliding_window"):
            raise ValueError(f"speculative_config: the draft model {spec.model} attends to another window than the "
                             "target (or has sliding and full-attention layers); use a draft that attends as the "
                             "target does")
        draft = loader.load_model(files, config, dtype, device, args.load_format, max_model_len,
                                  quantization=spec.quantization, batch_invariant=args.batch_invariant)
        sizing = KVCacheSizing.for_model(draft.config, cache_engine.block_size, dtype)
        draft_cache = CacheEngine(sizing.num_layers, cache_engine.num_blocks, cache_engine.block_size,
                                  sizing.num_kv_heads, sizing.head_dim, dtype, device, cache_engine.num_cpu_blocks)
        logger.info("draft model %s: %.1fM parameters; its KV cache: %d blocks (%.1f MiB) beside the target's",
                    spec.model, sum(p.numel() for p in draft.parameters()) / 1e6, cache_engine.num_blocks,
                    cache_engine.num_blocks * sizing.bytes_per_block / 2**20)
    return DraftModelRunner(model, cache_engine, sampler, device, draft, draft_cache, **kwargs)
