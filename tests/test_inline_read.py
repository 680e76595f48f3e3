"""The warm read served on the event loop: the residency check, and the fall back to the reader
thread when the cache file's pages are not in RAM."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from bench.mount_procs import drop_page_cache
from fuse_mount.block_cache import INLINE_MAX_BLOCKS, BlockCache
from fuse_mount.block_store import EXTENT_VALUE_BYTES, VALUE_BYTES, BlockKey, BlockStore
from fuse_mount.residency import (MAX_CHECK_PAGES, PAGE_SIZE, ResidencyProbe, buffer_address,
                                  merged_spans, run_stretch, value_spans, will_need)
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import metric

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
FILE_PAGES = 16
RUN_READS = "neuralcache_cache_run_reads_total"


@pytest.fixture
def mapped_file(tmp_path: Path):
    path = tmp_path / "pages"
    path.write_bytes(os.urandom(FILE_PAGES * PAGE_SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        yield path, mm


def evict(data_file: Path, stretches: list[tuple[int, int]]) -> None:
    """Put the map's pages under each stretch ``(address, length)`` out of this process's page
    tables, then the cache file out of RAM."""
    for address, length in stretches:
        start = address & ~(PAGE_SIZE - 1)
        assert _libc.madvise(start, address + length - start, mmap.MADV_DONTNEED) == 0
    drop_page_cache(data_file)


def address_of(cache: BlockCache, key: BlockKey) -> int | None:
    """Where the cache believes the block's value lies in its map, if it knows."""
    return cache._addresses.get(cache.keys.key(*key))


def test_a_buffer_in_memory_is_resident() -> None:
    probe = ResidencyProbe()
    data = os.urandom(3 * PAGE_SIZE + 5)
    start = buffer_address(data)
    assert probe.all_resident([start, start + PAGE_SIZE + 1], 2 * PAGE_SIZE)
    assert probe.all_resident([start + 3 * PAGE_SIZE, start], 5)  # apart and out of order
    assert probe.all_resident([], PAGE_SIZE)


def test_a_stretch_longer_than_one_check_is_asked_about_in_pieces() -> None:
    """A prefetch window's cached blocks may span more than one ``mincore`` call covers: its
    pages are resident if all are, and a page missing past the first piece is seen."""
    pages = MAX_CHECK_PAGES + 8
    with mmap.mmap(-1, pages * PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as mm:
        for i in range(pages):
            mm[i * PAGE_SIZE] = 1  # private anonymous memory is resident once written
        with memoryview(mm) as view:
            start = buffer_address(view)
        probe = ResidencyProbe()
        assert probe.all_resident([start], pages * PAGE_SIZE)
        mm.madvise(mmap.MADV_DONTNEED, (MAX_CHECK_PAGES + 3) * PAGE_SIZE, PAGE_SIZE)  # freed
        assert not probe.all_resident([start], pages * PAGE_SIZE)
        assert probe.all_resident([start], (MAX_CHECK_PAGES + 3) * PAGE_SIZE)


def test_the_address_is_the_buffers_own() -> None:
    data = bytearray(100)
    view = memoryview(data).toreadonly()
    assert buffer_address(view[10:]) == buffer_address(view) + 10
    with pytest.raises(TypeError):
        buffer_address(3)


def test_an_evicted_page_of_a_file_mapping_is_not_resident(mapped_file) -> None:
    path, mm = mapped_file
    mm.madvise(mmap.MADV_RANDOM)  # a fault reads its page only (as LMDB's map is set up)
    probe = ResidencyProbe()
    view = memoryview(mm)
    base = buffer_address(view)
    page = [base + i * PAGE_SIZE for i in range(FILE_PAGES)]
    assert view[3 * PAGE_SIZE] >= 0 and view[9 * PAGE_SIZE] >= 0  # touch two pages
    mm.madvise(mmap.MADV_DONTNEED)  # unmap them from this process, so that
    drop_page_cache(path)  # the page cache may drop them
    if probe.all_resident(page[3:4], PAGE_SIZE):
        pytest.skip("this filesystem keeps the file in the page cache")
    assert not probe.all_resident(page, PAGE_SIZE)
    assert not probe.all_resident([page[9]], 1)
    assert view[9 * PAGE_SIZE] >= 0  # read back from the disk
    assert probe.all_resident([page[9]], PAGE_SIZE)
    assert not probe.all_resident([page[9]], PAGE_SIZE + 1)  # reaches into page 10
    assert not probe.all_resident([page[9], page[15]], 1)  # checked apart, the second fails
    assert not probe.all_resident([page[15], page[9]], 1)
    view.release()


def _filled_store(path: Path, blocks: int) -> dict[BlockKey, bytes]:
    store = BlockStore(str(path), 4 * blocks * BLOCK_SIZE)
    data = {BlockKey(1, 1, b): os.urandom(BLOCK_SIZE) for b in range(blocks)}
    # Stamp rows written apart from their puts, without addresses: a cache whose rows do not
    # say where the values lie (as an older one's), so that a first read must find out.
    store.write_batch(data, [], {})
    store.write_batch({}, [], dict.fromkeys(data, (0, BLOCK_SIZE, None)))
    store.close()
    return data


def test_a_run_whose_pages_were_evicted_is_read_by_the_thread_then_inline(
        tmp_path: Path) -> None:
    blocks, first, count = 16, 8, 4
    data = _filled_store(tmp_path, blocks)
    cache = BlockCache(BlockStore(str(tmp_path), 4 * blocks * BLOCK_SIZE),
                       4 * blocks * BLOCK_SIZE)
    keys = [BlockKey(1, 1, b) for b in range(first, first + count)]
    expected = b"".join(data[k] for k in keys)

    async def read() -> bytes | None:
        return await cache.read_run(1, 1, first, count)

    inline = metric(RUN_READS, {"path": "inline"})
    thread = metric(RUN_READS, {"path": "reader_thread"})
    try:
        # Indexed at mount without reading the values: a first read, in the thread, finds
        # where they lie in the map.
        assert not cache._addresses
        assert trio.run(cache.read_run, 1, 1, 0, blocks) == b"".join(data.values())
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 1
        addresses = [address_of(cache, k) for k in keys]
        probe = ResidencyProbe()
        evict(tmp_path / "data.mdb",
              [(a & ~(PAGE_SIZE - 1), 2 * PAGE_SIZE) for a in cache._addresses.values()])
        if probe.all_resident(addresses, 1):
            pytest.skip("this filesystem keeps the file in the page cache")
        assert cache.store.read_run_resident(1, 1, first, count, addresses, probe) is None
        assert trio.run(read) == expected
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 2
        assert metric(RUN_READS, {"path": "inline"}) == inline
        # The thread's read brought the pages back: the same run is now served on the loop.
        assert trio.run(read) == expected
        assert metric(RUN_READS, {"path": "inline"}) == inline + 1
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 2
    finally:
        cache.close()


class _Posts:
    """Stands in for the cache's page-in thread: records what it is handed."""

    def __init__(self) -> None:
        self.posted: list[tuple[object, tuple[object, ...]]] = []

    def post(self, fn: object, *args: object) -> None:
        self.posted.append((fn, args))

    def close(self) -> None:
        pass


def test_a_run_on_the_disk_queued_behind_another_read_has_its_pages_asked_for_at_once(
        tmp_path: Path) -> None:
    """Two reads of runs whose pages are on the disk, at once: the first goes to the reader
    thread, which asks for its pages itself; the second, queued behind it, has the page-in
    thread ask for its values as it is queued, not when the reader thread gets to it."""
    blocks, count = 16, 4
    data = _filled_store(tmp_path, blocks)
    cache = BlockCache(BlockStore(str(tmp_path), 4 * blocks * BLOCK_SIZE),
                       4 * blocks * BLOCK_SIZE)
    posts = _Posts()
    try:
        assert trio.run(cache.read_run, 1, 1, 0, blocks) == b"".join(data.values())
        evict(tmp_path / "data.mdb",
              [(a & ~(PAGE_SIZE - 1), 2 * PAGE_SIZE) for a in cache._addresses.values()])
        if ResidencyProbe().all_resident(list(cache._addresses.values()), 1):
            pytest.skip("this filesystem keeps the file in the page cache")
        cache._pager.close()
        cache._pager = posts  # type: ignore[assignment]
        read: dict[int, bytes | None] = {}

        async def read_two() -> None:
            async def one(first: int) -> None:
                read[first] = await cache.read_run(1, 1, first, count)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0)
                nursery.start_soon(one, 8)

        trio.run(read_two)
        for first in (0, 8):
            assert read[first] == b"".join(data[BlockKey(1, 1, b)]
                                           for b in range(first, first + count))
        assert len(posts.posted) == 1
        fn, args = posts.posted[0]
        assert fn is will_need
        second = [first for first in (0, 8)
                  if args[0] == [address_of(cache, BlockKey(1, 1, b))
                                 for b in range(first, first + count)]]
        assert len(second) == 1 and args[1] == VALUE_BYTES
    finally:
        cache.close()


def test_addresses_follow_writes_and_evictions(tmp_path: Path) -> None:
    """A block written in this mount is read inline once its batch is on disk; a block
    evicted and written again gets its new address."""
    capacity = 4 * BLOCK_SIZE
    cache = BlockCache(BlockStore(str(tmp_path), capacity), capacity)
    keys = [BlockKey(1, 1, b) for b in range(6)]
    blocks = {k: os.urandom(BLOCK_SIZE) for k in keys}

    async def main() -> None:
        for k in keys[:4]:
            cache.put(k, blocks[k])
        assert await cache.read_run(1, 1, 0, 2) is None  # still in memory: get_many's
        await cache.flush()
        inline = metric(RUN_READS, {"path": "inline"})
        assert await cache.read_run(1, 1, 0, 4) == b"".join(blocks[k] for k in keys[:4])
        assert metric(RUN_READS, {"path": "inline"}) == inline + 1
        for k in keys[4:]:
            cache.put(k, blocks[k])  # evicts blocks 0 and 1
        assert address_of(cache, keys[0]) is None and address_of(cache, keys[1]) is None
        await cache.flush()
        blocks[keys[0]] = os.urandom(BLOCK_SIZE)
        cache.put(keys[0], blocks[keys[0]])
        await cache.flush()
        assert await cache.read_run(1, 1, 0, 1) == blocks[keys[0]]
        assert metric(RUN_READS, {"path": "inline"}) == inline + 2
        with cache.store.env.begin(db=cache.store._blocks, buffers=True) as txn:
            for k in cache.held_keys():
                assert address_of(cache, k) == buffer_address(txn.get(k.pack()))
    try:
        trio.run(main)
    finally:
        cache.close()


def test_runs_past_the_inline_limit_and_missing_blocks_go_to_the_thread(
        tmp_path: Path) -> None:
    blocks = INLINE_MAX_BLOCKS + 1
    data = _filled_store(tmp_path, blocks)
    cache = BlockCache(BlockStore(str(tmp_path), 4 * blocks * BLOCK_SIZE),
                       4 * blocks * BLOCK_SIZE)
    probe = ResidencyProbe()
    try:
        # Not wholly stored: the resident read declines, like read_run.
        located = cache.store.read_run_located(1, 1, blocks - 1, 1)
        assert located is not None
        known = located[1] * 2
        assert cache.store.read_run_resident(1, 1, blocks - 1, 2, known, probe) is None
        assert cache.store.read_run_resident(1, 1, 0, 0, [], probe) == b""
        thread = metric(RUN_READS, {"path": "reader_thread"})
        whole = trio.run(cache.read_run, 1, 1, 0, blocks)
        assert whole == b"".join(data[BlockKey(1, 1, b)] for b in range(blocks))
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 1
        assert len(cache._addresses) == blocks  # learnt, though the run was too long to inline
        # Its first and last values lie close: the thread gets their stretch, and the places
        # of the blocks between are neither looked up nor learnt again.
        keys = cache.keys.run(1, 1, 0, blocks)
        middle = {k: cache._addresses.pop(k) for k in keys[1:-1]}
        assert trio.run(cache.read_run, 1, 1, 0, blocks) == whole
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 2
        assert not any(k in cache._addresses for k in middle)
        # Ends far apart (say, written at different times): every block's place is looked
        # up, and the unknown ones learnt.
        cache._addresses[keys[-1]] += 1 << 30
        assert trio.run(cache.read_run, 1, 1, 0, blocks) == whole
        assert metric(RUN_READS, {"path": "reader_thread"}) == thread + 3
        assert all(cache._addresses[k] == address for k, address in middle.items())
    finally:
        cache.close()


def test_a_runs_stretch_is_given_only_if_its_values_can_lie_together() -> None:
    start, value = 1 << 30, VALUE_BYTES
    assert run_stretch(start, start, 1, value) == (start, value)
    side_by_side = (start, 3 * PAGE_SIZE + value)
    assert run_stretch(start, start + 3 * PAGE_SIZE, 4, value) == side_by_side
    assert run_stretch(start + 3 * PAGE_SIZE, start, 4, value) == side_by_side  # either order
    assert run_stretch(start, start + 8 * PAGE_SIZE, 4, value) is not None  # a few pages between
    assert run_stretch(start, start + 100 * PAGE_SIZE, 4, value) is None  # others' pages between


def test_stretches_share_a_span_where_close() -> None:
    page = PAGE_SIZE
    assert merged_spans([]) == []
    # Out of order; the first three at most MERGE_GAP_PAGES apart, the last further.
    stretches = [(20 * page, 10), (2 * page + 16, 100), (3 * page, page), (6 * page, 10)]
    assert merged_spans(stretches) == [(2 * page, 6 * page + 10), (20 * page, 20 * page + 10)]


class AlwaysOut(ResidencyProbe):
    """Says no page is in RAM, so that ``pages_to_read`` shows what it would ask for."""

    def spans_resident(self, spans: list[tuple[int, int]]) -> bool:
        return False


def test_a_windows_values_are_asked_for_where_each_lies(tmp_path: Path) -> None:
    """A page-in names every value whose place is known, also values a later write put
    outside the stretch between the run's first and last (a cache filled by several readers
    at once): guessed from the ends, those were left on the disk for the reader to wait on."""
    blocks = 128
    _filled_store(tmp_path, blocks)
    cache = BlockCache(BlockStore(str(tmp_path), 4 * blocks * BLOCK_SIZE),
                       4 * blocks * BLOCK_SIZE)
    window = [(1, 1, 0, blocks)]

    def covered(spans: list[tuple[int, int]], address: int) -> bool:
        return any(start <= address and address + VALUE_BYTES <= end for start, end in spans)
    try:
        assert trio.run(cache.read_run, 1, 1, 0, blocks) is not None  # learns where they lie
        assert cache.pages_to_read(window) is None  # just read: in RAM
        keys = cache.keys.run(1, 1, 0, blocks)
        cache._probe = AlwaysOut()
        wanted = cache.pages_to_read(window)
        assert wanted is not None and wanted.blocks == blocks
        assert all(covered(wanted.spans, cache._addresses[k]) for k in keys)
        moved = cache._addresses[keys[50]] = cache._addresses[keys[-1]] + (1 << 30)
        wanted = cache.pages_to_read(window)
        assert wanted is not None and wanted.blocks == blocks and covered(wanted.spans, moved)
        for key in keys[1:-1]:  # places not known: not asked for, not counted
            del cache._addresses[key]
        wanted = cache.pages_to_read(window)
        assert wanted is not None and wanted.blocks == 2 and len(wanted.spans) == 2
    finally:
        cache.close()


@given(st.lists(st.tuples(st.integers(0, 1 << 24), st.sampled_from(
    [8, VALUE_BYTES, PAGE_SIZE + 1, EXTENT_VALUE_BYTES])), max_size=40))
def test_value_spans_are_the_merged_spans_of_the_values(stretches: list[tuple[int, int]]) -> None:
    places = np.array([place for place, _ in stretches], dtype=np.int64)
    lengths = np.array([length for _, length in stretches], dtype=np.int64)
    assert value_spans(places, lengths) == merged_spans(stretches)


def test_where_blocks_lie_is_known_again_after_a_remount(tmp_path: Path) -> None:
    """The stamp rows record where each value lies in the cache file, so a remount reads its
    blocks inline at once without having read them (or their pages) to build its index."""
    capacity = 16 * BLOCK_SIZE
    keys = [BlockKey(1, 1, b) for b in range(4)]
    blocks = {k: os.urandom(BLOCK_SIZE) for k in keys}
    cache = BlockCache(BlockStore(str(tmp_path), capacity), capacity)

    async def fill() -> None:
        for k in keys:
            cache.put(k, blocks[k])
        await cache.flush()
    trio.run(fill)
    cache.close()
    cache = BlockCache(BlockStore(str(tmp_path), capacity), capacity)
    try:
        located = cache.store.read_run_located(1, 1, 0, len(keys))
        assert located is not None
        assert [address_of(cache, k) for k in keys] == located[1]
        inline = metric(RUN_READS, {"path": "inline"})
        assert trio.run(cache.read_run, 1, 1, 0, len(keys)) == b"".join(blocks.values())
        assert metric(RUN_READS, {"path": "inline"}) == inline + 1
    finally:
        cache.close()
