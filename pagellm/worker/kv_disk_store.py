"""The KV tier's files: a block's K/V of every layer of its group, copied out of the pool and written
by a background thread; read back and checked into a pool block before the forward pass.

A file is a header (magic, the block's hash, the payload's length and CRC-32) then the payload: for
each layer of the group, the block's K then its V, as the pool's bytes. A file is written under a
temporary name and renamed into place (``os.replace``), so that readers and concurrent writers (other
processes on the same folder) only ever see whole files; a torn, truncated or foreign file fails the
header's checks and is a failed read (the block is recomputed), never a wrong block. Which blocks to
save, read and delete is the scheduler's (``core/disk_index.py``, ``SchedulerOutput.disk_moves``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections.abc import Sequence

import torch

from pagellm.core.disk_index import block_file_name
from pagellm.core.sched_output import DiskMoves

logger = logging.getLogger(__name__)

MAGIC = b"PGLKVB01"
HEADER = struct.Struct("<8s16sQI4x")  # magic, block hash (128 bits), payload bytes, CRC-32 of the payload


def _block_bytes(pool: torch.Tensor, block_id: int) -> torch.Tensor:
    """One block of a pool as a flat uint8 view."""
    return pool[block_id].reshape(-1).view(torch.uint8)


class KVDiskStore:
    """Saves, reads and deletes block files for every KV cache group (``group_dirs[g]``: group g's
    folder; ``group_caches[g]``: its layers' (K, V) pools, as ``CacheEngine.group_kv_caches``).

    Saves are copied out of the pool at once (before the step reuses the block) and queued to one
    writer thread; until written, a read of the block is served from the copy. Deletes run on the same
    thread, after the writes queued before them. Write errors (a full disk, a folder made read-only) are
    logged and the block stays unsaved: a later read of it fails and the block is recomputed."""

    # Bytes of copies waiting for the writer past which a save is skipped (a disk slower than the
    # evictions must not take the host's memory; a skipped block is recomputed when needed).
    MAX_PENDING_BYTES = 1 << 30

    def __init__(self, group_dirs: Sequence[str], group_caches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]
                 ) -> None:
        self.group_dirs = list(group_dirs)
        self.group_caches = [list(c) for c in group_caches]
        self.block_nbytes = [sum(_block_bytes(k, 0).numel() + _block_bytes(v, 0).numel() for k, v in caches)
                             for caches in self.group_caches]
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_errors = 0
        self.skipped_saves = 0
        self._pending_bytes = 0
        self._pending: dict[tuple[int, int], torch.Tensor] = {}  # (group, hash) -> bytes not written yet
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int, int, torch.Tensor | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="pagellm-kv-disk-writer", daemon=True)
        self._thread.start()

    def path(self, group: int, block_hash: int) -> str:
        return os.path.join(self.group_dirs[group], block_file_name(block_hash))

    # ----------------------------------------------------------- the step
    def save_blocks(self, group: int, saves: list[tuple[int, int]], wait: bool = False) -> None:
        """Copy each (block id, hash) out of the pool now and queue its file's write; past the bound on
        unwritten copies, skip the block, or with ``wait`` wait for the writer first."""
        for block_id, h in saves:
            if wait and self._pending_bytes + self.block_nbytes[group] > self.MAX_PENDING_BYTES:
                self.flush()
            if self._pending_bytes + self.block_nbytes[group] > self.MAX_PENDING_BYTES:
                self.skipped_saves += 1
                if self.skipped_saves == 1:
                    logger.warning("KV tier: the disk is slower than the evictions; blocks are skipped while %d MiB "
                                   "wait to be written", self.MAX_PENDING_BYTES >> 20)
                continue
            parts = [_block_bytes(pool, block_id) for kv in self.group_caches[group] for pool in kv]
            data = torch.cat(parts).cpu()
            with self._lock:
                self._pending[(group, h)] = data
                self._pending_bytes += data.numel()
            self._queue.put(("write", group, h, data))

    def delete_blocks(self, group: int, hashes: list[int]) -> None:
        for h in hashes:
            self._queue.put(("delete", group, h, None))

    def load_blocks(self, group: int, loads: list[tuple[int, int]]) -> list[int]:
        """Read each (hash, block id) into the pool; returns the block ids whose read failed."""
        failed = []
        for h, block_id in loads:
            data = self._read(group, h)
            if data is None:
                failed.append(block_id)
                continue
            offset = 0
            for kv in self.group_caches[group]:
                for pool in kv:
                    dst = _block_bytes(pool, block_id)
                    n = dst.numel()
                    dst.copy_(data[offset:offset + n])
                    offset += n
        return failed

    def apply(self, disk_moves: list[DiskMoves], when: str) -> list[tuple[int, int]]:
        """``when`` "before": the saves (before any other move or write); "after": the deletes and the reads.
        Returns (group, block id) of the failed reads."""
        failures: list[tuple[int, int]] = []
        for group, moves in enumerate(disk_moves):
            if when == "before":
                self.save_blocks(group, moves.saves)
            else:
                self.delete_blocks(group, moves.deletes)
                failures += [(group, b) for b in self.load_blocks(group, moves.loads)]
        return failures

    def _read(self, group: int, h: int) -> torch.Tensor | None:
        with self._lock:
            pending = self._pending.get((group, h))
        if pending is not None:
            self.bytes_read += pending.numel()
            return pending
        path = self.path(group, h)
        expected = self.block_nbytes[group]
        raw = bytearray(HEADER.size + expected + 1)  # (one byte more: a longer file is found out)
        try:
            with open(path, "rb") as f:
                n = f.readinto(raw)
        except OSError as e:
            logger.warning("KV tier: cannot read %s (%s): recomputing the block", path, e)
            return None
        why = self._check(memoryview(raw)[:n], h, expected)
        if why is not None:
            logger.warning("KV tier: %s %s: recomputing the block and deleting the file", path, why)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used, for the other processes' and the next start's LRU order
        self.bytes_read += expected
        return torch.frombuffer(raw, dtype=torch.uint8, count=expected, offset=HEADER.size)

    @staticmethod
    def _check(raw: memoryview, h: int, expected: int) -> str | None:
        """Why a file's bytes are not block ``h``'s (None: they are)."""
        if len(raw) != HEADER.size + expected:
            return f"has {len(raw)} bytes, not {HEADER.size + expected} (torn, truncated or another layout)"
        magic, key, length, crc = HEADER.unpack_from(raw)
        if magic != MAGIC or key != h.to_bytes(16, "little") or length != expected:
            return "has a header of another block or format"
        if zlib.crc32(raw[HEADER.size:]) != crc:
            return "fails its checksum"
        return None

    # ------------------------------------------------------------- writer
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, group, h, data = item
                if op == "write":
                    assert data is not None
                    self._write(group, h, data)
                    with self._lock:
                        self._pending_bytes -= data.numel()
                        if self._pending.get((group, h)) is data:
                            del self._pending[(group, h)]
                else:
                    try:
                        os.unlink(self.path(group, h))
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        logger.warning("KV tier: cannot delete %s: %s", self.path(group, h), e)
            finally:
                self._queue.task_done()

    def _write(self, group: int, h: int, data: torch.Tensor) -> None:
        path = self.path(group, h)
        payload = data.numpy().data  # (a memoryview of the copy itself: no other copy)
        header = HEADER.pack(MAGIC, h.to_bytes(16, "little"), payload.nbytes, zlib.crc32(payload))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self.write_errors += 1
            log = logger.warning if self.write_errors <= 3 else logger.debug
            log("KV tier: cannot write %s (%s): the block will be recomputed when needed", path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        self.bytes_written += len(header) + payload.nbytes

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
