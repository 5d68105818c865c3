"""Start-up of the KV tier on disk (``--kv-offload-dir``, ``--kv-offload-size``): the folder checked, each
KV cache group's folder named by the model's fingerprint, the index (core) and the store (worker).

A block on disk is only ever read by an engine that computes the same K/V for the same tokens: its
group's folder is named by a fingerprint of the weights (each weight file's name, size, modification
time and first and last MiB), the config, the dtype, the KV cache dtype, the block size, the quantization,
the batch-invariance setting, the tensor-parallel rank and size, the group's layers and window, and a
longrope model's switch length. A block's file is named by its chained prefix hash, which holds the
request's cache salt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from pagellm.config import EngineArgs, parse_memory
from pagellm.core.disk_index import DiskIndex
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.model import loader
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.kv_disk_store import HEADER, KVDiskStore

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of the files and of the fingerprint below: a change makes new folders
_SAMPLE = 2**20  # bytes hashed at each end of a weight file


def _file_identity(path: Path) -> list[Any]:
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if st.st_size > 2 * _SAMPLE:
            f.seek(st.st_size - _SAMPLE)
        h.update(f.read(_SAMPLE))
    return [path.name, st.st_size, st.st_mtime_ns, h.hexdigest()]


def weights_identity(files: loader.ModelFiles, args: EngineArgs) -> list[Any]:
    """What tells one checkpoint's weights from another's, without reading them whole."""
    if args.load_format == "dummy":
        return ["dummy", args.seed]
    paths = [files.gguf] if files.gguf is not None else loader.safetensors_files(files.folder)
    return [_file_identity(Path(p)) for p in paths]


def model_fingerprint(files: loader.ModelFiles, args: EngineArgs, config: Any, dtype: torch.dtype,
                      kv_cache_manager: KVCacheManager, cache_engine: CacheEngine, rank: int = 0) -> list[str]:
    """One fingerprint (hex) per KV cache group: equal only where the blocks hold the same K/V."""
    k_pool = cache_engine.kv_caches[0][0]
    common = {
        "version": FORMAT_VERSION,
        "weights": weights_identity(files, args),
        "config": config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config),
        "dtype": str(dtype),
        "kv_dtype": str(k_pool.dtype),
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "block_shape": list(k_pool.shape[1:]),
        "quantization": args.quantization,
        "batch_invariant": args.batch_invariant,
        "tp": [rank, args.tensor_parallel_size],
        "switch_length": kv_cache_manager.switch_length,
        "device": cache_engine.kv_caches[0][0].device.type,
    }
    out = []
    for g, group in enumerate(kv_cache_manager.groups):
        layers = len(cache_engine.group_kv_caches[g])
        key = json.dumps({**common, "group": g, "layers": layers, "window": group.sliding_window}, sort_keys=True,
                         default=str)
        out.append(hashlib.sha256(key.encode()).hexdigest()[:32])
    return out


def prepare_root(folder: str) -> Path:
    """The tier's folder, created if only it is missing; ValueError naming the problem otherwise."""
    root = Path(folder).expanduser()
    if not root.exists():
        if not root.parent.is_dir():
            raise ValueError(f"kv_offload_dir (--kv-offload-dir) {folder!r}: its parent folder {str(root.parent)!r} "
                             "does not exist")
        try:
            root.mkdir(exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir (--kv-offload-dir) {folder!r}: cannot create it ({e})") from None
    if not root.is_dir():
        raise ValueError(f"kv_offload_dir (--kv-offload-dir) {folder!r} is not a folder")
    return root


def _check_writable(folder: Path) -> None:
    probe = folder / f".probe-{os.getpid()}-{uuid.uuid4().hex}.tmp"
    try:
        probe.write_bytes(b"pagellm")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"kv_offload_dir (--kv-offload-dir): cannot write in {str(folder)!r} ({e})") from None


def open_disk_tier(args: EngineArgs, files: loader.ModelFiles, config: Any, dtype: torch.dtype,
                   kv_cache_manager: KVCacheManager, cache_engine: CacheEngine) -> KVDiskStore:
    """Check the folder, attach the index to ``kv_cache_manager`` and return the store for the runner."""
    assert args.kv_offload_dir is not None
    root = prepare_root(args.kv_offload_dir)
    capacity = parse_memory(args.kv_offload_size)
    fingerprints = model_fingerprint(files, args, config, dtype, kv_cache_manager, cache_engine)
    group_dirs = []
    for fp in fingerprints:
        folder = root / fp
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir (--kv-offload-dir): cannot create {str(folder)!r} ({e})") from None
        _check_writable(folder)
        group_dirs.append(str(folder))
    store = KVDiskStore(group_dirs, cache_engine.group_kv_caches)
    block_bytes = [n + HEADER.size for n in store.block_nbytes]
    if capacity < max(block_bytes):
        store.close()
        raise ValueError(f"kv_offload_size (--kv-offload-size) {args.kv_offload_size!r} is smaller than one KV "
                         f"block's file ({max(block_bytes)} bytes)")
    index = DiskIndex(group_dirs, block_bytes, capacity)
    kv_cache_manager.attach_disk(index)
    free = shutil.disk_usage(root).free
    if free < capacity - index.total_bytes:
        logger.warning("KV tier on disk: %s has %.1f GiB free, less than the %.1f GiB --kv-offload-size leaves to "
                       "fill; writes that do not fit are skipped (those blocks are recomputed)", root, free / 2**30,
                       (capacity - index.total_bytes) / 2**30)
    logger.info("KV tier on disk: %s, up to %.1f GiB; %d blocks there already for this model (%.1f MiB)", root,
                capacity / 2**30, len(index), index.total_bytes / 2**20)
    return store



def save_cached_blocks(manager: KVCacheManager, store: KVDiskStore) -> int:
    """Write every cached block that is only in memory to the tier (at shutdown, so that a restarted
    engine finds what this one computed, not only what it evicted), oldest first; returns how many."""
    index = manager.disk
    if index is None:
        return 0
    total = 0
    for g, group in enumerate(manager.groups):
        saves = [(block.block_id, h) for h, block in group.pool.cached_blocks.items() if not index.has(g, h)]
        if not saves:
            continue
        if not total:
            logger.info("KV tier on disk: writing the cached blocks before stopping")
        for _, h in saves:
            index.add(g, h)
        store.save_blocks(g, saves, wait=True)
        total += len(saves)
    for g, h in index.take_deletes():
        store.delete_blocks(g, [h])
    return total
