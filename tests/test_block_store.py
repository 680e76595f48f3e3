"""``BlockStore``'s layout on disk: a block's head fills one LMDB page, its tail lies apart;
and the mount's warning when a full cache would not fit on its disk.

Round trips through the cache (any size, evictions, reopening) are the state machine's in
``test_block_cache``; these pin down what that cannot see: the pages a block takes, a tail
damaged on disk, and a cache written in the old two-page layout.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lmdb
import pytest

from fabric.checksum import block_checksum
from fuse_mount.block_store import HEAD_BYTES, BlockKey, BlockStore, disk_shortfall
from fuse_mount.daemon import _warn_if_the_disk_is_short
from neuralcache.blocks import BLOCK_SIZE
from tests.test_block_cache import block_bytes

BLOCKS = 256


def _stored(path: Path, sizes: list[int]) -> tuple[BlockStore, dict[BlockKey, bytes]]:
    store = BlockStore(str(path), len(sizes) * BLOCK_SIZE)
    blocks = {BlockKey(1, 1, i): block_bytes(BlockKey(1, 1, i), size, 0)
              for i, size in enumerate(sizes)}
    store.write_batch(blocks, [], {k: (i, len(v), None) for i, (k, v) in enumerate(blocks.items())})
    return store, blocks


def test_a_whole_block_takes_one_page_of_the_cache_file(tmp_path: Path) -> None:
    store, _ = _stored(tmp_path, [BLOCK_SIZE] * BLOCKS)
    pages = store.env.info()["last_pgno"] + 1
    store.close()
    # One head page per block, plus leaf and branch pages for keys, tails and stamp rows
    # (~50 bytes each): the two-page layout took more than 2 * BLOCKS.
    assert BLOCKS < pages < BLOCKS * 1.15 + 16


@pytest.mark.parametrize("size", [1, HEAD_BYTES - 1, HEAD_BYTES, HEAD_BYTES + 1, BLOCK_SIZE])
def test_blocks_either_side_of_the_head_read_back_whole(tmp_path: Path, size: int) -> None:
    store, blocks = _stored(tmp_path, [BLOCK_SIZE, size])
    assert store.read_run(1, 1, 0, 2) == b"".join(blocks.values())
    assert store.get_many(list(blocks)) == (blocks, [])
    store.close()


@pytest.mark.parametrize("tail", [b"", b"x" * 24, None], ids=["emptied", "rewritten", "deleted"])
def test_a_damaged_tail_fails_the_checksum(tmp_path: Path, tail: bytes | None) -> None:
    store, blocks = _stored(tmp_path, [BLOCK_SIZE] * 3)
    key = BlockKey(1, 1, 1)
    with store.env.begin(write=True, db=store._tails) as txn:
        if tail is None:
            txn.delete(key.pack())
        else:
            txn.put(key.pack(), tail)
    assert store.read_run(1, 1, 0, 3) is None  # the run refuses, get_many says which
    found, corrupt = store.get_many(list(blocks))
    assert corrupt == [key] and found == {k: v for k, v in blocks.items() if k != key}
    store.close()


def test_a_cache_in_the_two_page_layout_is_replaced_at_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key, data = BlockKey(1, 1, 0), block_bytes(BlockKey(1, 1, 0), BLOCK_SIZE, 0)
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=1 << 30)
    with env.begin(write=True) as txn:
        blocks, stamps = env.open_db(b"blocks", txn=txn), env.open_db(b"stamps", txn=txn)
        for i in range(4096):  # 32 MiB of file in the old layout
            other = BlockKey(2, 1, i).pack()
            txn.put(other, block_checksum(data) + data, db=blocks)
            txn.put(other, (i).to_bytes(8, "big"), db=stamps)
        txn.put(key.pack(), block_checksum(data) + data, db=blocks)
        txn.put(key.pack(), (7).to_bytes(8, "big"), db=stamps)
    env.close()
    old_size = (tmp_path / "data.mdb").stat().st_size

    with caplog.at_level(logging.WARNING, logger="fuse_mount.block_store"):
        store = BlockStore(str(tmp_path), 4 * BLOCK_SIZE)
    assert "older NeuralCache" in caplog.text and "4097 blocks" in caplog.text
    assert (tmp_path / "data.mdb").stat().st_size < old_size / 100  # the disk given back
    assert store.index() == [] and store.get_many([key]) == ({}, [])
    store.write_batch({key: data}, [], {key: (1, BLOCK_SIZE, None)})
    assert store.read_run(1, 1, 0, 1) == data
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fuse_mount.block_store"):
        store = BlockStore(str(tmp_path), 4 * BLOCK_SIZE)  # the new layout is kept
    assert caplog.text == "" and store.get_many([key]) == ({key: data}, [])
    store.close()


def test_disk_shortfall_counts_the_cache_file_already_there() -> None:
    assert disk_shortfall(1000, file_bytes=0, free_bytes=2000) == 0
    assert disk_shortfall(1000, file_bytes=0, free_bytes=500) == 550  # 1000 + 5 % - 500
    assert disk_shortfall(1000, file_bytes=600, free_bytes=500) == 0


def test_the_mounts_disk_check_warns_when_a_full_cache_cannot_fit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, _ = _stored(tmp_path, [BLOCK_SIZE])
    store.close()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with caplog.at_level(logging.WARNING, logger="fuse_mount.daemon"):
        _warn_if_the_disk_is_short(str(tmp_path), 4 * BLOCK_SIZE)
        assert caplog.text == ""
        _warn_if_the_disk_is_short(str(tmp_path), 2 * free + (1 << 40))
    assert "lacks" in caplog.text and "neuralcache_cache_write_errors_total" in caplog.text
