"""What the KV tier on disk holds: one file per full block, by KV cache group and prefix hash, LRU order.

Plain Python (files are only listed, stat'ed and named here; the worker reads and writes them,
``worker/kv_disk_store.py``). Each KV cache group has its folder under the tier's root, named by the
model's fingerprint for that group (weights, dtypes, block size, tensor-parallel rank, group: see
``engine/kv_offload.py``), so that only a block computed the same way is ever read back. A file is
named by the block's chained prefix hash (``block_pool.hash_block_key``: stable across processes), so
a restarted process, or another one on the same folder, finds the blocks the others wrote.

The index is this process's view: the files found at start-up (oldest first, by modification time),
the blocks it asked to write, and files another process wrote since, found on a lookup that misses
(one ``stat``). It keeps the tier within ``capacity_bytes`` by evicting the least recently used files
(the deletes go to the worker, in order with its writes). A file the index lists may still be gone or
torn when it is read: the worker then reports the block as a failed read and the block is recomputed.
"""

from __future__ import annotations

import os
from collections import OrderedDict

SUFFIX = ".kv"


def block_file_name(block_hash: int) -> str:
    """The file of a block in its group's folder."""
    return f"{block_hash:032x}{SUFFIX}"


def parse_block_file_name(name: str) -> int | None:
    """The block hash a file name stands for; None for anything else (temporary files, strangers)."""
    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
        return None
    try:
        return int(name[:32], 16)
    except ValueError:
        return None


class DiskIndex:
    """The blocks on disk of each KV cache group, least recently used first, and the tier's counters.

    ``group_dirs[g]``: group ``g``'s folder (it exists); ``block_bytes[g]``: the size of one of its
    files; ``capacity_bytes``: the most the files of these folders may take.
    """

    def __init__(self, group_dirs: list[str], block_bytes: list[int], capacity_bytes: int) -> None:
        if len(group_dirs) != len(block_bytes):
            raise ValueError("one folder and one block size per KV cache group")
        self.group_dirs = list(group_dirs)
        self.block_bytes = list(block_bytes)
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[int, int], int] = OrderedDict()  # (group, hash) -> bytes
        self.total_bytes = 0
        # Counters (the metrics read them): blocks read back, files evicted, reads that failed.
        self.hit_blocks = 0
        self.evicted_files = 0
        self.failed_reads = 0
        self.pending_deletes: list[tuple[int, int]] = []  # (group, hash) evicted, for the worker to delete
        # Blocks whose read failed: never read again by this process (the worker deletes the file, but a
        # folder it cannot write keeps it), until this process writes the block anew.
        self._bad: set[tuple[int, int]] = set()
        self._scan()

    def _scan(self) -> None:
        found = []
        for group, folder in enumerate(self.group_dirs):
            with os.scandir(folder) as it:
                for entry in it:
                    h = parse_block_file_name(entry.name)
                    if h is None:
                        continue
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, group, h, st.st_size))
        for _, group, h, size in sorted(found):
            self._entries[(group, h)] = size
            self.total_bytes += size
        self._evict_over_capacity()

    def __len__(self) -> int:
        return len(self._entries)

    def path(self, group: int, block_hash: int) -> str:
        return os.path.join(self.group_dirs[group], block_file_name(block_hash))

    def has(self, group: int, block_hash: int) -> bool:
        """Whether this process knows the block is on disk (no file system call)."""
        return (group, block_hash) in self._entries

    def contains(self, group: int, block_hash: int) -> bool:
        """Whether the block is on disk: known, or written by another process since (one ``stat``)."""
        if (group, block_hash) in self._entries:
            return True
        if (group, block_hash) in self._bad:
            return False
        try:
            size = os.stat(self.path(group, block_hash)).st_size
        except OSError:
            return False
        self._insert(group, block_hash, size)
        return True

    def touch(self, group: int, block_hash: int) -> None:
        """The block was read: it becomes the most recently used."""
        if (group, block_hash) in self._entries:
            self._entries.move_to_end((group, block_hash))

    def add(self, group: int, block_hash: int) -> None:
        """The block is being written; files past the capacity, least recently used first, are evicted."""
        self._bad.discard((group, block_hash))
        self._insert(group, block_hash, self.block_bytes[group])

    def discard(self, group: int, block_hash: int) -> None:
        """The block is not on disk after all (a read failed): forget it."""
        self._bad.add((group, block_hash))
        size = self._entries.pop((group, block_hash), None)
        if size is not None:
            self.total_bytes -= size

    def take_deletes(self) -> list[tuple[int, int]]:
        deletes, self.pending_deletes = self.pending_deletes, []
        return deletes

    def _insert(self, group: int, block_hash: int, size: int) -> None:
        old = self._entries.pop((group, block_hash), None)
        self.total_bytes += size - (old or 0)
        self._entries[(group, block_hash)] = size
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while self.total_bytes > self.capacity_bytes and self._entries:
            key, size = self._entries.popitem(last=False)
            self.total_bytes -= size
            self.evicted_files += 1
            self.pending_deletes.append(key)

    def assert_consistent(self) -> None:
        assert self.total_bytes == sum(self._entries.values()), "the tier's byte count drifted"
        assert self.total_bytes <= self.capacity_bytes, "the tier is over its capacity"
