"""The on-disk half of the block cache: LMDB on local NVMe, called from worker threads.

Keys are ``(file id, version, block)`` packed big-endian, so one file version's blocks sit
together in key order; a new version of a file has new keys, so its old blocks can never be
served for it. Each value carries the block's checksum, checked again on every read, so a
damaged cache file costs a re-fetch, never wrong bytes.
"""

from __future__ import annotations

import itertools
import os
import struct
from typing import Iterable, NamedTuple

import lmdb
import xxhash

from fabric.checksum import block_checksum
from fabric.protocol import CHECKSUM_BYTES
from neuralcache.blocks import block_count

_KEY = struct.Struct(">QQQ")
_STAMP = struct.Struct(">Q")
_CHECKSUM = struct.Struct(">Q")
"""A stored checksum as an int: ``block_checksum`` is xxh3-64 packed this way, and comparing
ints saves a bytes object per block on the range read."""

PAGES_PER_BLOCK = 2
"""A 4 KiB block plus its checksum exceeds one 4 KiB LMDB page and lands on two overflow pages."""
MAP_SLACK = 64 * 1024 * 1024
"""Room beyond the blocks for LMDB's branch pages, the stamp table and free-page bookkeeping."""


class BlockKey(NamedTuple):
    file_id: int
    version: int
    block: int

    def pack(self) -> bytes:
        return _KEY.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> "BlockKey":
        return cls(*_KEY.unpack(raw))


KeyTuple = tuple[int, int, int]
"""A block key as a plain tuple: equal to, and hashing like, the ``BlockKey`` it names."""


def run_keys(file_id: int, version: int, first: int, count: int) -> list[KeyTuple]:
    """The keys of blocks ``[first, first + count)`` of one file version, as plain tuples.

    They find the same entries as ``BlockKey``s in dicts keyed by them, and cost less: built
    in C (a 1 MiB read needs 256), and, unlike instances of a tuple subclass, left alone by
    the garbage collector once it has seen them, so the last-use stamps that warm reads leave
    behind in memory do not make every collection walk the whole cache.
    """
    return list(zip(itertools.repeat(file_id, count), itertools.repeat(version, count),
                    range(first, first + count)))


class IndexEntry(NamedTuple):
    key: BlockKey
    size: int
    stamp: int


def map_size_for(capacity: int) -> int:
    """LMDB map size that holds ``capacity`` bytes of blocks."""
    blocks = block_count(capacity)
    return blocks * PAGES_PER_BLOCK * os.sysconf("SC_PAGE_SIZE") + MAP_SLACK


class BlockStore:
    """Blocks and their last-use stamps in one LMDB environment."""

    def __init__(self, path: str, capacity: int) -> None:
        os.makedirs(path, exist_ok=True)
        # sync=False: a cache may lose its last batches on power loss; checksums catch damage.
        self.env = lmdb.open(path, map_size=map_size_for(capacity), max_dbs=2, sync=False,
                             metasync=False, readahead=False, max_readers=256)
        self._blocks = self.env.open_db(b"blocks")
        self._stamps = self.env.open_db(b"stamps")

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    def get_many(self, keys: Iterable[BlockKey]) -> tuple[dict[BlockKey, bytes], list[BlockKey]]:
        """Blocks found (verified), and keys whose stored bytes failed their checksum."""
        found: dict[BlockKey, bytes] = {}
        corrupt: list[BlockKey] = []
        with self.env.begin(db=self._blocks, buffers=True) as txn:
            for key in keys:
                raw = txn.get(key.pack())
                if raw is None:
                    continue
                data = bytes(raw[CHECKSUM_BYTES:])
                if block_checksum(data) == bytes(raw[:CHECKSUM_BYTES]):
                    found[key] = data
                else:
                    corrupt.append(key)
        return found, corrupt

    def read_run(self, file_id: int, version: int, first: int, count: int) -> bytes | None:
        """Blocks ``[first, first + count)`` of one file version joined, each checksum verified,
        or None unless every one of them is stored and intact (``get_many`` then sorts out which).

        One read transaction and one cursor walk over the neighbouring keys, the values taken as
        views of LMDB's map and copied once, by the join: per block this costs a fraction of a
        ``get`` and a ``bytes`` copy (``python -m bench.read_path_costs``).
        """
        if count <= 0:
            return b""
        with self.env.begin(db=self._blocks, buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_key(_KEY.pack(file_id, version, first)):
                return None
            values = list(itertools.islice(cursor.iternext(keys=False), count))
            # Keys are unique and sorted: `count` values from the first key to the expected
            # last one are exactly the run, with no block missing in between.
            if len(values) != count or cursor.key() != _KEY.pack(file_id, version,
                                                                  first + count - 1):
                return None
            parts = [value[CHECKSUM_BYTES:] for value in values]
            try:
                for value, part in zip(values, parts):
                    if xxhash.xxh3_64_intdigest(part) != _CHECKSUM.unpack_from(value)[0]:
                        return None
            except struct.error:  # a damaged value shorter than its checksum
                return None
            return b"".join(parts)

    def write_batch(self, puts: dict[BlockKey, bytes], deletes: Iterable[BlockKey],
                    stamps: dict[BlockKey | KeyTuple, int]) -> None:
        """Apply one batch in one write transaction (all or nothing)."""
        with self.env.begin(write=True) as txn:
            for key, data in puts.items():
                txn.put(key.pack(), block_checksum(data) + data, db=self._blocks)
            for key in deletes:
                packed = key.pack()
                txn.delete(packed, db=self._blocks)
                txn.delete(packed, db=self._stamps)
            for key, stamp in stamps.items():
                txn.put(_KEY.pack(*key), _STAMP.pack(stamp), db=self._stamps)

    def index(self) -> list[IndexEntry]:
        """Every cached block with its size and last-use stamp, least recently used first."""
        entries: list[IndexEntry] = []
        with self.env.begin(buffers=True) as txn:
            stamps = txn.cursor(db=self._stamps)
            for raw_key, raw_value in txn.cursor(db=self._blocks):
                key = bytes(raw_key)
                stamp_raw = stamps.get(key)
                stamp = _STAMP.unpack(stamp_raw)[0] if stamp_raw is not None else 0
                # A damaged value may be shorter than its checksum; it is caught on read, and
                # must not count as negative bytes until then.
                size = max(0, len(raw_value) - CHECKSUM_BYTES)
                entries.append(IndexEntry(BlockKey.unpack(key), size, stamp))
        entries.sort(key=lambda e: e.stamp)
        return entries
