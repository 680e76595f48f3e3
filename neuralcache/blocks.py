"""Block geometry shared by the cache, the mount and the prefetcher.

Everything the spoke caches, fetches or predicts is addressed in fixed 4 KiB blocks, the unit the
reference system's predictor works in and the page size of the kernel's page cache.
"""

from __future__ import annotations

from typing import NamedTuple

BLOCK_SIZE = 4096
"""Bytes per cache block; the last block of a file may be shorter."""


class BlockRange(NamedTuple):
    """Blocks ``first`` .. ``first + count - 1`` of one file."""

    first: int
    count: int

    @property
    def end(self) -> int:
        """One past the last block."""
        return self.first + self.count


def block_count(size: int) -> int:
    """Number of blocks a file of ``size`` bytes occupies."""
    return -(-size // BLOCK_SIZE)


def blocks_for_read(offset: int, length: int, size: int) -> BlockRange:
    """The blocks a read of ``length`` bytes at ``offset`` touches, clipped to the file's
    ``size``."""
    if offset < 0 or length < 0:
        raise ValueError(f"negative read: offset={offset} length={length}")
    end = min(offset + length, size)
    if end <= offset:
        return BlockRange(offset // BLOCK_SIZE, 0)
    first = offset // BLOCK_SIZE
    return BlockRange(first, (end - 1) // BLOCK_SIZE - first + 1)


def block_length(block: int, size: int) -> int:
    """Bytes held by block number ``block`` of a file of ``size`` bytes (0 past the end)."""
    return max(0, min(BLOCK_SIZE, size - block * BLOCK_SIZE))


def contiguous_runs(blocks: list[int]) -> list[BlockRange]:
    """Group sorted, distinct block numbers into maximal contiguous ranges (one range object
    per range: a fetch or a prefetch asks this of every block it covers)."""
    if not blocks:
        return []
    if blocks[-1] - blocks[0] == len(blocks) - 1:  # sorted and distinct: no gap anywhere
        return [BlockRange(blocks[0], len(blocks))]
    runs: list[BlockRange] = []
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1:
            runs.append(BlockRange(start, prev - start + 1))
            start = b
        prev = b
    runs.append(BlockRange(start, prev - start + 1))
    return runs


KEY_SHIFT = 40
"""Bits reserved for the block number in a packed block key: files up to 2**40 blocks (4 PiB)."""


def block_key(file_id: int, block: int) -> int:
    """One int naming block ``block`` of file ``file_id`` (cheaper to hash than a tuple)."""
    return (file_id << KEY_SHIFT) | block


def block_span(offset: int, length: int) -> tuple[int, int]:
    """Half-open block interval ``[first, stop)`` covering the bytes of a read."""
    if length <= 0:
        return offset // BLOCK_SIZE, offset // BLOCK_SIZE
    return offset // BLOCK_SIZE, (offset + length - 1) // BLOCK_SIZE + 1
