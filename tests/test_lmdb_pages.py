"""Reading a cache file's table trees from LMDB's page layout (``fuse_mount.lmdb_pages``).

Checked against LMDB's own page counts (``txn.stat``) on real cache files, with trees several
levels deep; and what a page that does not read as LMDB's layout does: a warning, no read-ahead
of that table, no exception for the mount.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from fuse_mount import lmdb_pages
from fuse_mount.block_store import (BLOCKS_TABLE, STAMPS_TABLE, TAILS_TABLE, BlockKey,
                                    BlockStore)
from fuse_mount.residency import ResidencyProbe, buffer_address, file_resident_bytes
from neuralcache.blocks import BLOCK_SIZE

TABLES = [STAMPS_TABLE, BLOCKS_TABLE, TAILS_TABLE]
BLOCKS = 20_000  # three levels in each table
RESIDENT_TIMEOUT = 30.0
"""Seconds the read-ahead may take to land (asynchronous, on a shared disk)."""


def _written(path: Path) -> BlockStore:
    """A cache of ``BLOCKS`` blocks of one file, with their last-use rows."""
    store = BlockStore(str(path), 2 * BLOCKS * BLOCK_SIZE)
    data = os.urandom(BLOCK_SIZE)
    for first in range(0, BLOCKS, 5_000):
        keys = [BlockKey(7, 1, b) for b in range(first, first + 5_000)]
        store.write_batch(dict.fromkeys(keys, data), [],
                          {k: (k.block, BLOCK_SIZE, None) for k in keys})
    return store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlockStore]:
    store = _written(tmp_path_factory.mktemp("cache"))
    yield store
    store.close()


def _counted_by_lmdb(store: BlockStore, name: bytes) -> tuple[int, int]:
    with store.env.begin() as txn:
        stat = txn.stat(store.env.open_db(name, txn=txn))
    return stat["branch_pages"] + stat["leaf_pages"], stat["depth"]


def _pages(store: BlockStore, name: bytes) -> list[int]:
    path = os.path.join(store.path, "data.mdb")
    with open(path, "rb") as file, store.env.begin() as txn:
        tree = lmdb_pages.table_tree(txn, name)
        assert tree is not None
        return lmdb_pages.tree_pages(
            lambda numbers: [os.pread(file.fileno(), 4096, n * 4096) for n in numbers], *tree)


@pytest.mark.parametrize("name", TABLES)
def test_a_tables_tree_is_every_branch_and_leaf_page_lmdb_counts(store: BlockStore,
                                                                 name: bytes) -> None:
    pages = _pages(store, name)
    counted, depth = _counted_by_lmdb(store, name)
    assert depth >= 3
    assert len(pages) == len(set(pages)) == counted


def test_page_in_asks_for_every_tree_page_up_to_the_limit(store: BlockStore) -> None:
    every = sum(_counted_by_lmdb(store, name)[0] for name in TABLES)
    assert lmdb_pages.page_in_tables(store.env, TABLES, 10 * every, store.will_need_bytes) == every
    assert lmdb_pages.page_in_tables(store.env, TABLES, 100, store.will_need_bytes) == 100


def test_an_empty_table_has_no_pages(tmp_path: Path) -> None:
    store = BlockStore(str(tmp_path), 16 * BLOCK_SIZE)
    try:
        with store.env.begin() as txn:
            assert lmdb_pages.table_tree(txn, BLOCKS_TABLE) is None
        assert store.page_in_trees() == 0
    finally:
        store.close()


def _resident(path: str, pages: list[int]) -> int:
    """How many of these pages of the file are in the page cache (one ``mincore`` each)."""
    probe = ResidencyProbe()
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            base = buffer_address(view)
            return sum(probe.all_resident([base + page * 4096], 4096) for page in pages)
        finally:
            view.release()


def test_the_pages_read_ahead_land_in_the_page_cache(tmp_path: Path) -> None:
    store = _written(tmp_path)
    pages = [page for name in TABLES for page in _pages(store, name)]
    store.close()
    path = os.path.join(tmp_path, "data.mdb")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident(path, pages) > len(pages) / 2:
        pytest.skip("this filesystem keeps the file in the page cache")
    store = BlockStore(str(tmp_path), 2 * BLOCKS * BLOCK_SIZE)
    try:
        assert store.page_in_trees() == len(pages)
        deadline = time.monotonic() + RESIDENT_TIMEOUT
        while _resident(path, pages) < len(pages):
            assert time.monotonic() < deadline, "the tree pages did not come into the page cache"
            time.sleep(0.05)
        # The blocks themselves (overflow pages, most of the file) were not read.
        assert file_resident_bytes(path) < os.path.getsize(path) / 4
    finally:
        store.close()


def test_a_page_not_in_lmdbs_layout_is_logged_and_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _written(tmp_path)
    branch = _pages(store, BLOCKS_TABLE)[1]  # a branch page below the root
    with open(os.path.join(store.path, "data.mdb"), "r+b") as file:
        os.pwrite(file.fileno(), b"\xff" * 16, branch * 4096)
    try:
        with caplog.at_level(logging.WARNING, logger="fuse_mount.lmdb_pages"):
            asked = lmdb_pages.page_in_tables(store.env, TABLES, 10**6, store.will_need_bytes)
        # The stamp table's pages were asked for; the blocks table stops the read-ahead.
        assert asked == _counted_by_lmdb(store, STAMPS_TABLE)[0]
        assert "could not read the cache file's table pages" in caplog.text
        assert f"page {branch} reads as page" in caplog.text
    finally:
        store.close()
