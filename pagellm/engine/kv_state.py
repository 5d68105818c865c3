"""What the KV cache holds right now, as plain JSON-able data: the dashboard's grid and request list,
and the bench's strip of the grid over time.

Pure functions of the KV cache manager and the scheduler. They read engine state, so call them
between two steps (``AsyncLLMEngine.read_between_steps`` in the server; a step observer in a bench).
No torch here: core objects only.
"""

from __future__ import annotations

from typing import Any

from pagellm.core.block_pool import KVBlock
from pagellm.core.kv_cache_manager import KVCacheManager, is_held
from pagellm.core.scheduler import Scheduler
from pagellm.core.sequence import Request, Sequence, SequenceStatus

# One character per device block in ``states``: compact enough to send the whole pool a few times a
# second, and the same codes the bench's strip records.
FREE, USED, SHARED, CACHED, PINNED = "f", "u", "s", "c", "p"
# The swap pool's blocks are listed apart (they are CPU blocks, not cells of the device pool).
SWAPPED = "w"
STATE_NAMES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached", PINNED: "pinned", SWAPPED: "swapped"}
# Who holds a pinned block (a prefix preloaded at start-up), in its list of holders.
PINNED_HOLDER = "(pinned)"
# The page's stylesheet uses the same colours (a test holds them equal).
STATE_COLOURS = {FREE: "#e5e7eb", USED: "#3b82f6", SHARED: "#7c3aed", CACHED: "#34d399", PINNED: "#f59e0b",
                 SWAPPED: "#ef4444"}
# Hashes are shown to tell blocks apart, not to look them up: 48 bits do that.
HASH_HEX_DIGITS = 12
# The hashes of free cached blocks are sent while there are at most this many of them: a long-running
# server with a large pool caches nearly every block, and formatting them all a few times a second
# would weigh on the engine. The hashes of the blocks in use are always sent.
MAX_CACHED_HASHES = 16384


def block_state_codes(manager: KVCacheManager) -> str:
    """The state of every device block of the first KV cache group's pool, by id, one character each
    (``STATE_NAMES``).

    A block held by a pin is ``pinned`` whoever else holds it; one held by several block tables is
    ``shared``; a free block still registered under a prefix hash is ``cached`` (evictable). Costs a
    pass over the cached blocks and the block tables, not over the whole pool.
    """
    group = manager.groups[0]
    pool = group.pool
    codes = bytearray(FREE.encode() * pool.num_blocks)
    cached, used, shared, pinned = (ord(c) for c in (CACHED, USED, SHARED, PINNED))
    for block in pool.cached_blocks.values():  # every hashed block, in use or free
        if block.ref_cnt == 0:
            codes[block.block_id] = cached
    for table in group.block_tables.values():
        for block in filter(is_held, table):
            codes[block.block_id] = shared if block.ref_cnt > 1 else used
    for block in group.pinned:
        codes[block.block_id] = pinned
    return codes.decode("ascii")


def short_hash(block_hash: int) -> str:
    return f"{block_hash & (2**64 - 1):016x}"[:HASH_HEX_DIGITS]


def kv_state(manager: KVCacheManager, scheduler: Scheduler) -> dict[str, Any]:
    """The pool cell by cell, the swap pool, the queued requests and the cache's counters.

    ``pool.states`` has one code per block of the first KV cache group's pool (the only one but for
    Gemma's, whose full-attention group it is; ``groups`` counts each group's blocks). Keyed by block
    id: ``ref_counts`` where above 1 (a block in use has 1 otherwise, a free or cached one 0),
    ``holders`` (request ids) of the blocks in use, ``hashes`` of the blocks in use and of the cached
    ones (those up to ``MAX_CACHED_HASHES``). The result shares nothing with the engine: it may be
    encoded while the next step runs.
    """
    group = manager.groups[0]
    pool = group.pool
    states = block_state_codes(manager)
    owner = _sequence_owners(scheduler)
    holders: dict[int, list[str]] = {}
    in_use: dict[int, KVBlock] = {}
    for seq_id, table in group.block_tables.items():
        rid = owner.get(seq_id, f"seq-{seq_id}")
        for block in filter(is_held, table):
            in_use[block.block_id] = block
            ids = holders.setdefault(block.block_id, [])
            if rid not in ids:  # the samples of one request (n > 1) share blocks: name it once
                ids.append(rid)
    for block in group.pinned:
        in_use[block.block_id] = block
        ids = holders.setdefault(block.block_id, [])
        if PINNED_HOLDER not in ids:
            ids.append(PINNED_HOLDER)
    hashes = {i: short_hash(b.block_hash) for i, b in in_use.items() if b.block_hash is not None}
    num_cached = pool.num_cached_free_blocks
    if num_cached <= MAX_CACHED_HASHES:
        hashes.update((b.block_id, short_hash(h)) for h, b in pool.cached_blocks.items() if b.ref_cnt == 0)
    swap_blocks = [[block.block_id, owner.get(seq_id, f"seq-{seq_id}")]
                   for seq_id, table in group.cpu_tables.items() for block in filter(is_held, table)]
    return {
        "num_steps": scheduler.stats.num_steps,
        "pool": {
            "num_blocks": pool.num_blocks,
            "block_size": manager.block_size,
            "states": states,
            "counts": {name: states.count(code) for code, name in STATE_NAMES.items() if code != SWAPPED},
            "ref_counts": {i: b.ref_cnt for i, b in in_use.items() if b.ref_cnt > 1},
            "hashes": hashes,
            "cached_hashes_sent": num_cached <= MAX_CACHED_HASHES,
            "holders": holders,
        },
        "swap": {
            "num_blocks": group.cpu_pool.num_blocks if group.cpu_pool is not None else 0,
            "blocks": swap_blocks,
        },
        # The KV cache groups (Gemma: full-attention and sliding layers, a pool each); ``pool`` above is
        # the first one's.
        "groups": [{"sliding_window": g.sliding_window, "num_blocks": g.pool.num_blocks,
                    "used_blocks": g.pool.num_used_blocks, "cached_blocks": g.pool.num_cached_free_blocks}
                   for g in manager.groups],
        # The KV tier on disk (--kv-offload-dir), None without one: its files as this process sees them.
        "disk": None if manager.disk is None else {
            "num_blocks": len(manager.disk),
            "bytes": manager.disk.total_bytes,
            "capacity_bytes": manager.disk.capacity_bytes,
            "hit_blocks": manager.disk.hit_blocks,
            "evictions": manager.disk.evicted_files,
            "failed_reads": manager.disk.failed_reads,
        },
        "requests": request_rows(manager, scheduler),
        "stats": {
            "kv_usage": manager.usage,
            "prefix_cache_queries": manager.prefix_cache_queries,
            "prefix_cache_hits": manager.prefix_cache_hits,
            "prefix_cache_hit_rate": (manager.prefix_cache_hits / manager.prefix_cache_queries
                                      if manager.prefix_cache_queries else 0.0),
            "num_preemptions": scheduler.stats.num_preemptions,
            "num_swap_outs": scheduler.stats.num_swap_outs,
            "num_recomputes": scheduler.stats.num_recomputes,
            "num_generated_tokens": scheduler.stats.num_generated_tokens,
        },
    }


def _sequence_owners(scheduler: Scheduler) -> dict[int, str]:
    """seq id -> request id for every queued sequence (only those can hold blocks)."""
    return {s.seq_id: s.request.request_id for q in (scheduler.running, scheduler.swapped, scheduler.waiting)
            for s in q}


def request_rows(manager: KVCacheManager, scheduler: Scheduler) -> list[dict[str, Any]]:
    """One row per queued request, running ones first, then swapped, then waiting (in policy order).

    A request is running while any of its samples runs, swapped while any is swapped out.
    """
    by_request: dict[int, tuple[Request, list[Sequence]]] = {}
    for queue in (scheduler.running, scheduler.swapped, scheduler.waiting):
        for seq in queue:
            by_request.setdefault(id(seq.request), (seq.request, []))[1].append(seq)
    rows = [_request_row(request, seqs, manager, scheduler) for request, seqs in by_request.values()]
    order = {"running": 0, "swapped": 1, "waiting": 2}
    rows.sort(key=lambda r: order[r["queue"]])  # stable: queue order within each
    return rows


def _request_row(request: Request, seqs: list[Sequence], manager: KVCacheManager,
                 scheduler: Scheduler) -> dict[str, Any]:
    statuses = {s.status for s in seqs}
    queue = ("running" if SequenceStatus.RUNNING in statuses
             else "swapped" if SequenceStatus.SWAPPED in statuses else "waiting")
    prompt = len(request.prompt_token_ids)
    group = manager.groups[0]  # (the pool the grid shows)
    device_blocks = {b.block_id for s in seqs for b in filter(is_held, group.block_tables.get(s.seq_id, ()))}
    ttft_slo = request.ttft_slo if request.ttft_slo is not None else scheduler.config.default_ttft_slo
    return {
        "request_id": request.request_id,
        "queue": queue,
        "n": len(request.seqs),
        "prompt_tokens": prompt,
        # The prompt's tokens whose K/V is computed (a prefix-cache hit counts as done).
        "prompt_done": max(min(s.num_computed_tokens, prompt) for s in seqs),
        "generated": max(s.num_output_tokens for s in request.seqs),
        "max_tokens": request.sampling_params.max_tokens,
        "blocks": len(device_blocks),
        "swapped_blocks": sum(len(list(filter(is_held, group.cpu_tables.get(s.seq_id, ())))) for s in seqs),
        "cached_tokens": request.seqs[0].num_cached_tokens,
        "priority": request.priority,
        "arrival_time": request.arrival_time,
        # The time-to-first-token deadline (sla policy), while the first token is still due.
        "ttft_deadline": (request.arrival_time + ttft_slo
                          if ttft_slo is not None and request.metrics.first_token_time is None else None),
        "preemptions": request.metrics.num_preemptions,
        # The LoRA adapter the request runs with (None: the base model).
        "lora_adapter": request.lora_request.lora_name if request.lora_request is not None else None,
    }
