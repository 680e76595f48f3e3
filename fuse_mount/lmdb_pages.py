"""Which pages of the cache file hold a table's tree, read from LMDB's on-disk format (0.9).

The cache maps its file without readahead (values are read at random), so a walk over pages on
disk faults them in one at a time: the index walk at mount (the stamp table), and, on the first
reads after a mount over a cache file that is not in the page cache, the lookups every read makes
in the blocks and tails tables, which then waited for the disk on the event loop (a warm
``bench.repro`` shuffled run: ~3,800 ``neuralcache_loop_disk_waits_total``). The tree pages
(branches and leaves; not the values on overflow pages, which are the blocks themselves) are a
small part of the file, ~160 bytes per block over the three tables (5,084 pages for 131,072
blocks), and can be had from the disk all at once. py-lmdb has no call
that walks a table without touching every value, so the tree is read here, from the pages of a
read transaction's snapshot, which LMDB never overwrites while the transaction is open.

Format (``mdb.c``): a named table's record in the main table is its ``MDB_db``, whose last field
is the root page; a page starts with its number, flags and the end of its node offsets; a branch
node's child page is split over its first three 16-bit fields.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Callable

import lmdb

from neuralcache.blocks import contiguous_runs

from .residency import advice_pieces

DATA_FILE = "data.mdb"
"""The file of an LMDB environment's directory that holds its pages (the other is its lock
file)."""

log = logging.getLogger(__name__)

_TABLE_RECORD = struct.Struct("=IHHQQQQQ")
"""``MDB_db``: pad, flags, depth, branch, leaf and overflow pages, entries, root page."""
_PAGE_HEADER = struct.Struct("=QHHHH")
"""``MDB_page``: page number, pad, flags, lower (end of the node offsets), upper."""
_NODE_OFFSET = struct.Struct("=H")
_NODE_HEADER = struct.Struct("=HHHH")
"""``MDB_node``: lo, hi, flags, key size; a branch node's child is lo | hi << 16 | flags << 32."""
P_BRANCH = 0x01
NO_PAGE = (1 << 64) - 1
"""``P_INVALID``: the root of an empty table."""


class PageLayoutError(Exception):
    """A page did not read as LMDB 0.9 lays it out (another format, or a damaged file)."""


def table_tree(txn: lmdb.Transaction, name: bytes) -> tuple[int, int] | None:
    """The root page and depth of the named table in ``txn``'s snapshot, None if it is empty."""
    record = txn.get(name)
    if record is None or len(record) != _TABLE_RECORD.size:
        raise PageLayoutError(f"table {name!r} has no record of {_TABLE_RECORD.size} bytes")
    _, _, depth, *_, root = _TABLE_RECORD.unpack(record)
    return None if root == NO_PAGE or depth == 0 else (root, depth)


def tree_pages(read_level: Callable[[list[int]], list[bytes]], root: int, depth: int
               ) -> list[int]:
    """Every branch and leaf page of a tree of ``depth`` levels under ``root``. Only the branch
    levels are read (``read_level`` gets a level's page numbers, returns their bytes): the last
    level is the leaves, named by the level above."""
    pages: list[int] = []
    level = [root]
    for _ in range(depth - 1):
        pages += level
        children: list[int] = []
        for number, page in zip(level, read_level(level)):
            stored, _, flags, lower, _ = _PAGE_HEADER.unpack_from(page)
            if stored != number or not flags & P_BRANCH:
                raise PageLayoutError(f"page {number} reads as page {stored}, flags {flags:#x}, "
                                      "where a branch page was expected")
            for i in range((lower - _PAGE_HEADER.size) // _NODE_OFFSET.size):
                (offset,) = _NODE_OFFSET.unpack_from(page, _PAGE_HEADER.size + 2 * i)
                lo, hi, top, _ = _NODE_HEADER.unpack_from(page, offset)
                children.append(lo | hi << 16 | top << 32)
        level = children
    return pages + level


def page_in_tables(env: lmdb.Environment, names: list[bytes], max_pages: int,
                   piece: int) -> int:
    """Have the kernel read the tree pages of these tables (at most ``max_pages`` of them, in
    the order given) into the page cache, each call asking for at most ``piece`` bytes (the
    file's ``residency.will_need_limit``); returns how many were asked for.

    The branch pages are read here, a level at a time, each level asked of the disk at once;
    the leaves are only asked for (``POSIX_FADV_WILLNEED``): the call does not wait for them.
    Advice: a file this cannot read is logged, and its tables' pages are then faulted in as
    they are used.
    """
    path = os.path.join(env.path(), DATA_FILE)
    page_size = env.stat()["psize"]
    asked = 0
    with open(path, "rb", buffering=0) as file, env.begin() as txn:
        fd = file.fileno()

        def will_need(numbers: list[int]) -> None:
            for run in contiguous_runs(sorted(numbers)):  # a tree names each page once
                for offset, length in advice_pieces(run.first * page_size,
                                                    (run.first + run.count) * page_size, piece):
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

        def read_level(numbers: list[int]) -> list[bytes]:
            will_need(numbers)
            return [os.pread(fd, page_size, number * page_size) for number in numbers]

        try:
            for name in names:
                tree = table_tree(txn, name)
                if tree is None:
                    continue
                pages = tree_pages(read_level, *tree)[:max_pages - asked]
                will_need(pages)
                asked += len(pages)
                if asked >= max_pages:
                    break
        except (PageLayoutError, struct.error, OSError) as exc:
            log.warning("could not read the cache file's table pages (%s): its lookups read "
                        "the disk a page at a time until they are in memory", exc)
    return asked
