"""``CacheWriter``: a batch written by the child process, read back by the daemon's own store.

What the cache does around it (a failed batch counted and its blocks forgotten, a killed
writer replaced) is ``test_block_cache``'s; these pin down the hand-over itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.cache_writer import CacheWriteError, CacheWriter
from fuse_mount.key_space import BLOCK_BITS, KeySpace
from neuralcache.blocks import BLOCK_SIZE
from tests.test_block_cache import block_bytes

CAPACITY = 64 * BLOCK_SIZE


def open_writer(path: Path) -> tuple[BlockStore, CacheWriter, KeySpace]:
    store, keys = BlockStore(str(path), CAPACITY), KeySpace()
    return store, CacheWriter(store.path, store.capacity, store.map_base, keys), keys


def test_a_batch_lands_where_the_writer_says_in_this_processs_map(tmp_path: Path) -> None:
    store, writer, keys = open_writer(tmp_path)
    blocks = {keys.key(1, 2, b): block_bytes(BlockKey(1, 2, b), BLOCK_SIZE, 0) for b in range(8)}
    placed = writer.write_batch(blocks, [], dict.fromkeys(blocks, (1, BLOCK_SIZE, None))).addresses
    data, addresses = store.read_run_located(1, 2, 0, 8)
    assert data == b"".join(blocks.values())
    assert store.map_base is not None
    assert [placed[k] for k in blocks] == addresses
    # The puts' stamp rows record their places (as offsets in the file): the next mount
    # knows them. So do later rows that carry an address of this process's map.
    where = {keys.triple(k): placed[k] for k in blocks}
    assert {e.key: e.address for e in store.index()} == where
    writer.write_batch({}, [], {k: (2, BLOCK_SIZE, placed[k]) for k in blocks})
    assert {e.key: (e.stamp, e.address) for e in store.index()} == {
        k: (2, a) for k, a in where.items()}
    # Deletes go through the writer too.
    writer.write_batch({}, list(blocks)[:4], {})
    assert [e.key for e in store.index()] == [keys.triple(k) for k in list(blocks)[4:]]
    writer.close()
    assert writer.pid is None
    store.close()


def test_an_error_in_the_writer_fails_that_batch_only(tmp_path: Path) -> None:
    store, writer, keys = open_writer(tmp_path)
    bad = 5 << BLOCK_BITS  # a key of a slot nobody gave out: the child's write raises
    with pytest.raises(CacheWriteError, match="IndexError"):
        writer.write_batch({bad: b"x"}, [], {})
    pid = writer.pid
    good = keys.key(1, 1, 0)
    writer.write_batch({good: b"y"}, [], {good: (1, 1, None)})
    assert writer.pid == pid  # the same child wrote the next batch
    assert store.get_many([BlockKey(1, 1, 0)]) == ({BlockKey(1, 1, 0): b"y"}, [])
    writer.close()
    store.close()


def test_a_new_writer_learns_every_file_version_again(tmp_path: Path) -> None:
    """The child names a key's block by the file versions the daemon told it of, a batch at a
    time: versions first seen after a batch reach it with the next, and a child started after
    one died hears of them all."""
    store, writer, keys = open_writer(tmp_path)
    first = keys.key(1, 1, 0)
    writer.write_batch({first: b"a"}, [], {first: (1, 1, None)})
    later = keys.key(2, 9, 5)  # a second version, after the child's first batch
    writer.write_batch({later: b"b"}, [], {later: (2, 1, None)})
    assert writer._proc is not None
    writer._proc.kill()
    writer._proc.wait()
    with pytest.raises(CacheWriteError):
        writer.write_batch({}, [], {})  # finds the child gone
    again = [keys.key(2, 9, 6), keys.key(1, 1, 1)]
    writer.write_batch(dict.fromkeys(again, b"c"), [], dict.fromkeys(again, (3, 1, None)))
    assert sorted(e.key for e in store.index()) == [(1, 1, 0), (1, 1, 1), (2, 9, 5), (2, 9, 6)]
    writer.close()
    store.close()


def test_keys_wider_than_64_bits_reach_the_child(tmp_path: Path) -> None:
    """Past 4,096 file versions a key no longer fits msgpack's 64-bit ints: it travels as
    its slot and its block."""
    store, writer, keys = open_writer(tmp_path)
    for file_id in range(5000):
        keys.base(file_id, 1)
    wide = keys.key(4999, 1, 3)
    assert wide >= 1 << 64
    writer.write_batch({wide: b"w"}, [], {wide: (1, 1, None)})
    assert [e.key for e in store.index()] == [(4999, 1, 3)]
    writer.write_batch({}, [wide], {})
    assert store.index() == []
    writer.close()
    store.close()
