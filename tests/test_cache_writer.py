"""``CacheWriter``: a batch written by the child process, read back by the daemon's own store.

What the cache does around it (a failed batch counted and its blocks forgotten, a killed
writer replaced) is ``test_block_cache``'s; these pin down the hand-over itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.cache_writer import CacheWriteError, CacheWriter
from neuralcache.blocks import BLOCK_SIZE
from tests.test_block_cache import block_bytes

CAPACITY = 64 * BLOCK_SIZE


def open_pair(path: Path) -> tuple[BlockStore, CacheWriter]:
    store = BlockStore(str(path), CAPACITY)
    return store, CacheWriter(store.path, store.capacity, store.map_base)


def test_a_batch_lands_where_the_writer_says_in_this_processs_map(tmp_path: Path) -> None:
    store, writer = open_pair(tmp_path)
    blocks = {BlockKey(1, 2, b): block_bytes(BlockKey(1, 2, b), BLOCK_SIZE, 0) for b in range(8)}
    placed = writer.write_batch(blocks, [], dict.fromkeys(blocks, (1, BLOCK_SIZE, None)))
    data, addresses = store.read_run_located(1, 2, 0, 8)
    assert data == b"".join(blocks.values())
    assert store.map_base is not None
    assert [placed[k] for k in blocks] == addresses
    # The puts' stamp rows record their places (as offsets in the file): the next mount
    # knows them. So do later rows that carry an address of this process's map.
    where = {tuple(k): placed[k] for k in blocks}
    assert {e.key: e.address for e in store.index()} == where
    writer.write_batch({}, [], {k: (2, BLOCK_SIZE, placed[k]) for k in blocks})
    assert {e.key: (e.stamp, e.address) for e in store.index()} == {
        k: (2, a) for k, a in where.items()}
    # Deletes go through the writer too.
    writer.write_batch({}, list(blocks)[:4], {})
    assert [e.key for e in store.index()] == [tuple(k) for k in list(blocks)[4:]]
    writer.close()
    assert writer.pid is None
    store.close()


def test_an_error_in_the_writer_fails_that_batch_only(tmp_path: Path) -> None:
    store, writer = open_pair(tmp_path)
    bad = BlockKey(1, 1, -1)  # no such key can be packed: the child's write raises
    with pytest.raises(CacheWriteError, match="int too large"):
        writer.write_batch({bad: b"x"}, [], {})
    pid = writer.pid
    good = BlockKey(1, 1, 0)
    writer.write_batch({good: b"y"}, [], {good: (1, 1, None)})
    assert writer.pid == pid  # the same child wrote the next batch
    assert store.get_many([good]) == ({good: b"y"}, [])
    writer.close()
    store.close()
