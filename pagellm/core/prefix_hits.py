"""Where a waiting sequence's prompt can start: its prefix-cache hit, and the blocks after it that the
KV tier on disk holds (read a step ahead of its admission, like a swap-in)."""

from __future__ import annotations

from pagellm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagellm.core.sequence import Sequence


def computes_whole_prompt(seq: Sequence) -> bool:
    """Whether ``seq`` must compute every prompt token: it asks for their logprobs, which a cache hit
    would skip."""
    request = seq.request
    # (Positions [0, num_prompt_tokens - 1) score a token; a one-token prompt has none to skip.)
    return request.wants_prompt_logprobs and request.num_scored_prompt_tokens < max(seq.num_prompt_tokens - 1, 1)


def prefix_hit(kv: KVCacheManager, seq: Sequence) -> KVCacheBlocks:
    """``seq``'s prefix-cache hit in every KV cache group (none where it computes its whole prompt)."""
    return kv.no_hit if computes_whole_prompt(seq) else kv.find_cached_prefix(seq)


def starts_disk_read(kv: KVCacheManager, seq: Sequence, hits: KVCacheBlocks, reserve: int) -> bool:
    """Whether blocks of ``seq``'s prompt past its prefix hit ``hits`` are read from the disk tier this
    step (keeping ``reserve`` blocks free)."""
    if kv.disk is None or seq.num_computed_tokens or computes_whole_prompt(seq):
        return False
    return kv.start_disk_load(seq, hits, reserve) > 0
