"""Block tables on top of the block pool: blocks are allocated as a sequence grows."""

from __future__ import annotations

from collections import Counter

from pagellm.core.block_pool import BlockPool, KVBlock
from pagellm.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each sequence to its block table and keeps the pool's counts honest."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not 1 <= block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq.seq_id, ())]

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        held = len(self.block_tables.get(seq.seq_id, ()))
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - held)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more K/V entries; False (and no change) if the pool is short."""
        needed = self.num_new_blocks_needed(seq, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(seq.seq_id, [])
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, seq: Sequence) -> int:
        """Return every block of ``seq``; the tail goes first so a prefix outlives it in the LRU."""
        table = self.block_tables.pop(seq.seq_id, None)
        if not table:
            return 0
        self.pool.free(reversed(table))
        return len(table)

    def assert_consistent(self) -> None:
        """Check the invariants of ARCHITECTURE.md; raises AssertionError on a violation."""
        self.pool.assert_consistent()
        holders: Counter[int] = Counter()
        for table in self.block_tables.values():
            for block in table:
                holders[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block}: ref count {block.ref_cnt} but held by {holders[block.block_id]} block tables"
            )
        used = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks, "free + used != total"
