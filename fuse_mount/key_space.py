"""Block keys as the mount holds them in memory: one int per block.

Outside the daemon's memory a block is named by ``(file id, version, block)``: in LMDB's rows,
in requests to the hub, as a ``BlockKey``. The dicts that the read path consults block by block
(the LRU order, last-use stamps, where values lie, queued writes, fetches in flight) key each
block by one int instead: its file version's slot, numbered in order of first sight, shifted
past the block number. A 1 MiB read looks up 256 blocks in several of these dicts; a tuple key
is built for each block and hashed again at every look-up (CPython does not keep a tuple's
hash), where an int hashes to itself, so that a run's keys also sit side by side in each
dict's table (docs/throughput.md, "Int keys", has what that saved). Ints are never tracked by
the garbage collector either, so the keys of a large cache add nothing to a collection's walk.

Slots are never reused within a process: a slot names one file version for as long as the
daemon runs, so blocks of an older version can never be taken for a newer one's.
"""

from __future__ import annotations

from typing import Callable

from .block_store import BlockKey, KeyTuple

BLOCK_BITS = 52
"""Bits of a key that hold the block number. A file's size fits in 63 bits (``st_size``), so
its blocks in 51: a block number can never reach into the slot's bits."""
BLOCK_MASK = (1 << BLOCK_BITS) - 1
slot_of: Callable[[int], int] = BLOCK_BITS.__rrshift__
"""The slot of a key, ``key >> BLOCK_BITS``, as a function in C: the cache's policy counts
held blocks by slot at every insert and eviction (``LruPolicy.held_in``)."""


class KeySpace:
    """Gives each file version a slot and turns block keys into ints and back."""

    def __init__(self) -> None:
        self._bases: dict[tuple[int, int], int] = {}
        self.versions: list[tuple[int, int]] = []
        """``(file id, version)`` of each slot, in slot order; only ever appended to."""

    def base(self, file_id: int, version: int) -> int:
        """The key of block 0 of this file version (the key of block ``b`` is ``base + b``)."""
        base = self._bases.get((file_id, version))
        if base is None:
            base = len(self.versions) << BLOCK_BITS
            self._bases[(file_id, version)] = base
            self.versions.append((file_id, version))
        return base

    def key(self, file_id: int, version: int, block: int) -> int:
        return self.base(file_id, version) + block

    def run(self, file_id: int, version: int, first: int, count: int) -> range:
        """The keys of blocks ``[first, first + count)`` of one file version."""
        start = self.base(file_id, version) + first
        return range(start, start + max(count, 0))

    def slot(self, file_id: int, version: int) -> int:
        """The slot of this file version (what ``slot_of`` gives for each of its keys)."""
        return slot_of(self.base(file_id, version))

    def triple(self, key: int) -> KeyTuple:
        file_id, version = self.versions[key >> BLOCK_BITS]
        return file_id, version, key & BLOCK_MASK

    def block_key(self, key: int) -> BlockKey:
        return BlockKey._make(self.triple(key))
