"""Builders shared by the scheduler and KV cache tests (as vLLM's tests/v1/core/utils.py):
a scheduler over a small pool on a fake clock, and requests of given lengths."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.core.sequence import Request
from pagellm.sampling_params import SamplingParams
from tests.core.fake_model import FakeClock

_ids = itertools.count()


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 32,
                     max_num_seqs: int = 8, max_model_len: int = 64, num_cpu_blocks: int = 0,
                     enable_prefix_caching: bool = False, eos_token_ids: Sequence[int] = (0,),
                     **config: Any) -> Scheduler:
    """A scheduler on a fake clock (``scheduler.clock``); ``config``: more SchedulerConfig fields."""
    cfg = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len, **config)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(cfg, kv, eos_token_ids=list(eos_token_ids), clock=FakeClock())


def create_request(prompt_len: int | None = None, max_tokens: int = 4, *,
                   prompt_token_ids: list[int] | None = None, arrival_time: float = 0.0, priority: int = 0,
                   cache_salt: str | None = None,
                   ttft_slo: float | None = None, tpot_slo: float | None = None,
                   **sampling: Any) -> Request:
    """A request of ``prompt_len`` tokens (or these ``prompt_token_ids``) that generates ``max_tokens``
    (EOS ignored unless ``ignore_eos=False``); ``sampling``: more SamplingParams fields."""
    ids = list(prompt_token_ids) if prompt_token_ids is not None else [5] * (prompt_len or 1)
    params = SamplingParams(max_tokens=max_tokens, **{"ignore_eos": True, **sampling})
    return Request(f"req{next(_ids)}", None, ids, params, arrival_time=arrival_time, priority=priority,
                   cache_salt=cache_salt, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
