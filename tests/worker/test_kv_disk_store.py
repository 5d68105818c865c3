"""The KV tier's files: round trip, read-after-write before the file exists, torn and foreign files,
concurrent writers on one folder, and a folder that cannot be written."""

from __future__ import annotations

import logging
import multiprocessing

import pytest
import torch

from pagellm.core.disk_index import block_file_name
from pagellm.core.sched_output import DiskMoves
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.kv_disk_store import HEADER, KVDiskStore

H = 0xABCDEF0123456789ABCDEF0123456789


def engine(dtype=torch.float32, num_blocks=6) -> CacheEngine:
    return CacheEngine(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                       device=torch.device("cpu"))


def fill(cache: CacheEngine, block_id: int, value: float) -> None:
    for k, v in cache.kv_caches:
        k[block_id].copy_((torch.randn_like(k[block_id].float()) + value).to(k.dtype))
        v[block_id].copy_((torch.randn_like(v[block_id].float()) - value).to(v.dtype))


def same_block(a: CacheEngine, ia: int, b: CacheEngine, ib: int) -> bool:
    return all(torch.equal(ka[ia].view(torch.uint8), kb[ib].view(torch.uint8))
               and torch.equal(va[ia].view(torch.uint8), vb[ib].view(torch.uint8))
               for (ka, va), (kb, vb) in zip(a.kv_caches, b.kv_caches))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_block_round_trips_through_its_file_and_a_new_store_reads_it(tmp_path, dtype):
    src = engine(dtype)
    fill(src, 2, 1.0)
    store = KVDiskStore([str(tmp_path)], src.group_kv_caches)
    store.apply([DiskMoves(saves=[(2, H)])], "before")
    # Read back before the writer got to it (from the copy), into another block.
    fill(src, 2, 5.0)  # the block is reused at once: the copy was taken before
    assert store.apply([DiskMoves(loads=[(H, 4)])], "after") == []
    store.close()
    path = tmp_path / block_file_name(H)
    assert path.stat().st_size == HEADER.size + store.block_nbytes[0] == store.bytes_written
    dst = engine(dtype)
    other = KVDiskStore([str(tmp_path)], dst.group_kv_caches)
    assert other.load_blocks(0, [(H, 1)]) == []
    assert same_block(src, 4, dst, 1) and not same_block(src, 2, dst, 1)
    assert other.bytes_read == other.block_nbytes[0]
    other.close()


def test_torn_foreign_and_missing_files_are_failed_reads_and_deleted(tmp_path, caplog):
    src = engine()
    fill(src, 0, 1.0)
    store = KVDiskStore([str(tmp_path)], src.group_kv_caches)
    hashes = [H + i for i in range(4)]
    store.save_blocks(0, [(0, h) for h in hashes])
    store.flush()
    paths = [tmp_path / block_file_name(h) for h in hashes]
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:-7])  # truncated
    own = paths[1].read_bytes()
    paths[1].write_bytes(own[:100] + bytes([own[100] ^ 1]) + own[101:])  # a bit flipped in the payload
    paths[2].write_bytes(data)  # block H's file under another block's name
    with caplog.at_level(logging.WARNING):
        failed = store.load_blocks(0, [(hashes[0], 1), (hashes[1], 2), (hashes[2], 3), (H + 99, 4)])
    assert failed == [1, 2, 3, 4]
    assert "checksum" in caplog.text and "truncated" in caplog.text and "another block" in caplog.text
    assert not paths[0].exists() and not paths[1].exists() and not paths[2].exists()
    assert store.load_blocks(0, [(hashes[3], 5)]) == []
    store.close()


def _write_many(folder: str, seed: int, n: int) -> None:
    torch.manual_seed(seed)
    cache = engine()
    fill(cache, 0, float(seed))
    store = KVDiskStore([folder], cache.group_kv_caches)
    for i in range(n):
        store.save_blocks(0, [(0, H)])  # every process writes the same file, over and over
        if i % 5 == 0:
            store.flush()
    store.close()


def test_concurrent_writers_on_one_folder_leave_a_whole_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), seed, 30)) for seed in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [p.name for p in tmp_path.iterdir()] == [block_file_name(H)]  # no temporary file left
    dst = engine()
    store = KVDiskStore([str(tmp_path)], dst.group_kv_caches)
    assert store.load_blocks(0, [(H, 0)]) == []  # one writer's whole block, never a mix
    store.close()


def test_a_folder_that_cannot_be_written_any_more_logs_and_skips_the_writes(tmp_path, caplog):
    # (The folder removed under the store: as a disk made read-only or full, the write fails; this way
    # the test runs as root too.)
    folder = tmp_path / "tier"
    folder.mkdir()
    src = engine()
    store = KVDiskStore([str(folder)], src.group_kv_caches)
    folder.rmdir()
    with caplog.at_level(logging.WARNING):
        store.save_blocks(0, [(0, H)])
        store.flush()
    assert store.write_errors == 1 and "cannot write" in caplog.text
    assert store.load_blocks(0, [(H, 1)]) == [1]  # never written: a miss, recomputed
    store.close()


def test_saves_past_the_pending_bound_are_skipped(tmp_path, monkeypatch):
    import threading

    src = engine()
    store = KVDiskStore([str(tmp_path)], src.group_kv_caches)
    monkeypatch.setattr(store, "MAX_PENDING_BYTES", store.block_nbytes[0])
    gate = threading.Event()
    write = store._write
    monkeypatch.setattr(store, "_write", lambda g, h, d: (gate.wait(10), write(g, h, d)))
    store.save_blocks(0, [(0, H), (1, H + 2)])  # the first waits for a slow disk; the second is past the bound
    assert store.skipped_saves == 1
    gate.set()
    store.flush()
    assert store._pending_bytes == 0
    assert (tmp_path / block_file_name(H)).exists() and not (tmp_path / block_file_name(H + 2)).exists()
    store.close()
