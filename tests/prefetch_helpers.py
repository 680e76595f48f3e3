"""Shared fixtures for the prefetcher tests: an in-memory cache view and small catalogs."""

from __future__ import annotations

from neuralcache.blocks import BLOCK_SIZE, block_key
from neuralcache.catalog import Catalog
from neuralcache.events import CacheView, LinkEstimate, PrefetchRequest

LINK = LinkEstimate(bandwidth=25e6, min_rtt=0.06)  # the 200 Mbit/s, 60 ms


class DictCache(CacheView):
    """A CacheView backed by a set of block keys."""

    def __init__(self, capacity: int = 1 << 30) -> None:
        self.keys: set[int] = set()
        self.capacity = capacity

    def contains(self, file_id: int, block: int) -> bool:
        return block_key(file_id, block) in self.keys

    def free_bytes(self) -> int:
        return self.capacity - len(self.keys) * BLOCK_SIZE

    def capacity_bytes(self) -> int:
        return self.capacity

    def fill(self, requests: list[PrefetchRequest]) -> None:
        for r in requests:
            for b in range(r.first, r.end):
                self.keys.add(block_key(r.file_id, b))


def shards(n: int = 4, size: int = 4 << 20, prefix: str = "data/shard") -> Catalog:
    """``n`` files of ``size`` bytes named so that name order is id order (ids 1..n)."""
    return Catalog([(i + 1, f"{prefix}-{i:03d}.bin", size) for i in range(n)])


def blocks_of(requests: list[PrefetchRequest]) -> set[tuple[int, int]]:
    return {(r.file_id, b) for r in requests for b in range(r.first, r.end)}
