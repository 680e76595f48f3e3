"""Extents: 16 aligned whole blocks put in one batch, stored as one LMDB value.

What the store keeps and refuses (pages taken, a damaged extent, a cache file with no room
for one), what the cache does with them (reads of any part, a block of one leaving the cache,
a remount), and a state machine of puts, reads, drops, flushes and reopens against a dict of
what was put.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import lmdb
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fabric.checksum import block_checksum
from fuse_mount import block_store
from fuse_mount.block_store import (EXTENT_BLOCKS, EXTENT_HEAD_BYTES, EXTENT_TAIL_BYTES,
                                    EXTENT_VALUE_BYTES, VALUE_BYTES, BlockKey, BlockStore,
                                    extent_of)
from fuse_mount.residency import ResidencyProbe, merged_spans
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import metric
from tests.test_block_cache import block_bytes, open_cache, run
from tests.test_inline_read import AlwaysOut, evict

FILE = (1, 1)
RUN_READS = "neuralcache_cache_run_reads_total"
THREAD = {"path": "reader_thread"}


def _blocks(first: int, count: int, size: int = BLOCK_SIZE) -> dict[BlockKey, bytes]:
    keys = [BlockKey(*FILE, b) for b in range(first, first + count)]
    return {key: block_bytes(key, size, 0) for key in keys}


def _joined(blocks: dict[BlockKey, bytes], first: int, count: int) -> bytes:
    return b"".join(blocks[BlockKey(*FILE, b)] for b in range(first, first + count))


def _written(path: Path, count: int, extents: list[int]) -> tuple[BlockStore, dict]:
    store = BlockStore(str(path), 2 * count * BLOCK_SIZE)
    blocks = _blocks(0, count)
    written = store.write_batch(blocks, [], {k: (1, BLOCK_SIZE, None) for k in blocks},
                                [BlockKey(*FILE, e) for e in extents])
    assert written.extents
    return store, blocks


def test_an_extent_takes_its_blocks_pages_and_reads_back_in_any_part(tmp_path: Path) -> None:
    store, blocks = _written(tmp_path, 64, [0, 16, 32])
    assert store.extents() == [BlockKey(*FILE, e) for e in (0, 16, 32)]
    # 16 pages per extent, one per block on its own, and a few for the tables' trees.
    assert 64 < store.env.info()["last_pgno"] + 1 < 64 + 16
    for first, count in [(0, 64), (0, 16), (3, 4), (14, 4), (30, 20), (40, 24), (47, 2)]:
        extents = sorted({extent_of(b) for b in range(first, first + count)} & {0, 16, 32})
        assert store.read_run(*FILE, first, count, extents=extents) == _joined(
            blocks, first, count), (first, count)
        data, addresses = store.read_run_located(*FILE, first, count, extents)
        assert data == _joined(blocks, first, count)
        # The places of the run widened to its extents: an extent's blocks a page apart.
        start = min([first, *extents])
        assert len(addresses) == max(first + count, *(e + EXTENT_BLOCKS for e in extents)) - start
        for extent in extents:
            at = addresses[extent - start:extent - start + EXTENT_BLOCKS]
            assert [a - at[0] for a in at] == list(range(0, EXTENT_BLOCKS * BLOCK_SIZE,
                                                         BLOCK_SIZE))
    # Read as if its blocks were on their own, a run of an extent finds no rows.
    assert store.read_run(*FILE, 0, 4) is None
    keys = list(blocks)
    assert store.get_many(keys[10:50]) == ({k: blocks[k] for k in keys[10:50]}, [])
    store.close()


@pytest.mark.parametrize("damage", ["tail", "short head", "byte"])
def test_a_damaged_extent_is_refused(tmp_path: Path, damage: str) -> None:
    store, blocks = _written(tmp_path, 32, [0, 16])
    packed = BlockKey(*FILE, 16).pack()
    with store.env.begin(write=True, buffers=False) as txn:
        if damage == "tail":
            txn.put(packed, b"x" * 24, db=store._extent_tails)
        else:
            head = bytearray(txn.get(packed, db=store._extents))
            if damage == "short head":
                # Cut short with a checksum that matches what is left: only its length shows.
                tail = txn.get(packed, db=store._extent_tails)[:EXTENT_TAIL_BYTES]
                head = block_checksum(bytes(head[8:-8]) + tail) + head[8:-8]
            else:
                head[EXTENT_HEAD_BYTES // 2] ^= 1
            txn.put(packed, bytes(head), db=store._extents)
    assert store.read_run(*FILE, 0, 32, extents=[0, 16]) is None
    assert store.read_run(*FILE, 22, 2, extents=[16]) is None  # the flipped byte is in 23
    assert store.read_run(*FILE, 2, 4, extents=[0]) == _joined(blocks, 2, 4)
    # Block by block, a block is checked against its own checksum; a row or value of the
    # wrong length fails them all.
    keys = list(blocks)
    found, corrupt = store.get_many([keys[3], keys[17], keys[23]])
    bad = [keys[23]] if damage == "byte" else [keys[17], keys[23]]
    assert corrupt == bad and found == {k: blocks[k] for k in (keys[3], keys[17]) if k not in bad}
    store.close()


def test_a_read_of_part_of_an_extent_checks_the_blocks_it_reads(tmp_path: Path) -> None:
    store, blocks = _written(tmp_path, 16, [0])
    packed = BlockKey(*FILE, 0).pack()
    with store.env.begin(write=True, buffers=False) as txn:
        row = bytearray(txn.get(packed, db=store._extent_tails))
        row[EXTENT_TAIL_BYTES + 5 * 8] ^= 1  # block 5's checksum
        txn.put(packed, bytes(row), db=store._extent_tails)
    assert store.read_run(*FILE, 4, 2, extents=[0]) is None
    assert store.read_run(*FILE, 6, 10, extents=[0]) == _joined(blocks, 6, 10)
    assert store.read_run(*FILE, 0, 16, extents=[0]) == _joined(blocks, 0, 16)  # the extent's own
    store.close()


def test_a_cache_file_without_room_for_an_extent_stores_its_blocks_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """LMDB needs 16 free pages side by side for an extent. A full cache file whose free pages
    lie apart (every other block evicted) has room for blocks, not for an extent."""
    monkeypatch.setattr(block_store, "MAP_SLACK", 0)
    store = BlockStore(str(tmp_path), 64 * BLOCK_SIZE)
    loose: list[BlockKey] = []
    while True:  # blocks of another file, 8 at a time, until the file is full
        batch = {BlockKey(2, 1, b): block_bytes(BlockKey(2, 1, b), BLOCK_SIZE, 0)
                 for b in range(len(loose), len(loose) + 8)}
        try:
            store.write_batch(batch, [], {k: (1, BLOCK_SIZE, None) for k in batch})
        except lmdb.MapFullError:
            break
        loose += batch
    store.close()
    # Room to delete in (their pages are freed once a later transaction commits), too little
    # at the file's end for an extent.
    monkeypatch.setattr(block_store, "MAP_SLACK", (EXTENT_BLOCKS // 2) * BLOCK_SIZE)
    store = BlockStore(str(tmp_path), 64 * BLOCK_SIZE)
    # One transaction each: LMDB reuses a page once a later transaction has committed.
    for key in loose[::2]:
        store.write_batch({}, [key], {})
    assert len(loose) // 2 > EXTENT_BLOCKS + 4  # room for its blocks, and their tree pages
    blocks = _blocks(0, EXTENT_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="fuse_mount.block_store"):
        written = store.write_batch(blocks, [], {k: (2, BLOCK_SIZE, None) for k in blocks},
                                    [BlockKey(*FILE, 0)])
    assert not written.extents and "no room in the cache file" in caplog.text
    assert store.extents() == []
    assert store.read_run(*FILE, 0, EXTENT_BLOCKS) == _joined(blocks, 0, EXTENT_BLOCKS)
    assert set(written.addresses) == set(blocks)
    store.close()


def test_extents_the_writer_stored_block_by_block_are_counted_and_read_so(
        tmp_path: Path) -> None:
    cache = open_cache(tmp_path, 64 * BLOCK_SIZE)
    writer = cache.writer

    class NoRoom:
        """The writer as it answers when the cache file has no 16 free pages side by side."""

        def write_batch(self, puts, deletes, stamps, extents=(), unpacked=()):  # type: ignore
            return writer.write_batch(puts, deletes, stamps, (), unpacked)

        def close(self) -> None:
            writer.close()
    cache.writer = NoRoom()  # type: ignore[assignment]
    refused = metric("neuralcache_cache_extents_refused_total")
    blocks = _blocks(0, 32)

    async def fill() -> None:
        cache.put_run(*FILE, 0, list(blocks.values()))
        await cache.flush()
    run(fill)
    assert metric("neuralcache_cache_extents_refused_total") == refused + 2
    assert cache.store.extents() == []
    assert run(cache.read_run, *FILE, 0, 32) == _joined(blocks, 0, 32)
    assert run(cache.read_run, *FILE, 5, 3) == _joined(blocks, 5, 3)
    cache.close()


def test_a_cache_stores_the_extents_a_batch_holds_whole(tmp_path: Path) -> None:
    capacity = 128 * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    blocks = _blocks(0, 40) | _blocks(50, 20) | _blocks(72, 16, size=100)

    async def fill() -> None:
        cache.put_run(*FILE, 0, list(_blocks(0, 40).values()))
        cache.put_run(*FILE, 50, list(_blocks(50, 20).values()))
        cache.put_run(*FILE, 72, list(_blocks(72, 16, size=100).values()))  # not whole
        await cache.flush()
    run(fill)
    # 0-15 and 16-31: whole and aligned; 48-63 lacks 48 and 49, 64-79 is short ones.
    assert cache.store.extents() == [BlockKey(*FILE, 0), BlockKey(*FILE, 16)]
    for first, count in [(0, 40), (5, 4), (14, 4), (30, 10), (52, 12)]:
        assert run(cache.read_run, *FILE, first, count) == _joined(blocks, first, count)
    cache.close()
    cache = open_cache(tmp_path, capacity)  # a remount knows them
    # From the middle of one extent into the next: a view of the two joined, not a copy.
    middle = run(cache.read_run, *FILE, 8, 16)
    assert isinstance(middle, memoryview) and middle == _joined(blocks, 8, 16)
    assert run(cache.read_run, *FILE, 3, 2) == _joined(blocks, 3, 2)  # inline, places known
    cache.close()


def test_a_block_leaving_the_cache_takes_its_extent_with_it(tmp_path: Path) -> None:
    capacity = 64 * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    told: list[BlockKey] = []
    cache.watch(told.append, lambda key: False)
    blocks = _blocks(0, 32)

    async def main() -> None:
        cache.put_run(*FILE, 0, list(blocks.values()))
        await cache.flush()
        assert cache.drop([BlockKey(*FILE, 20)]) == 1
        await cache.flush()
    run(main)
    # The prefetcher hears of every block gone: the extent's others have no rows of their own.
    assert sorted(told) == [BlockKey(*FILE, b) for b in range(16, 32)]
    assert cache.store.extents() == [BlockKey(*FILE, 0)]
    assert [e.key for e in cache.store.index()] == [tuple(k) for k in list(blocks)[:16]]
    assert cache.policy.used == 16 * BLOCK_SIZE
    # Put again, one by one, they are blocks on their own.
    run(_put_each, cache, {k: v for k, v in blocks.items() if k.block >= 16})
    assert cache.store.extents() == [BlockKey(*FILE, 0)]
    assert run(cache.read_run, *FILE, 10, 12) == _joined(blocks, 10, 12)
    cache.close()


async def _put_each(cache, blocks: dict[BlockKey, bytes]) -> None:
    for key, data in blocks.items():
        cache.put(key, data)
        await cache.flush()


def test_a_damaged_extent_is_dropped_and_counted(tmp_path: Path) -> None:
    cache = open_cache(tmp_path, 64 * BLOCK_SIZE)
    blocks = _blocks(0, 16)

    async def fill() -> None:
        cache.put_run(*FILE, 0, list(blocks.values()))
        await cache.flush()
    run(fill)
    with cache.store.env.begin(write=True) as txn:
        txn.put(BlockKey(*FILE, 0).pack(), b"y" * 24, db=cache.store._extent_tails)
    corrupt = metric("neuralcache_cache_corrupt_blocks_total")
    assert run(cache.read_run, *FILE, 0, 16) is None
    assert run(cache.get_many, list(blocks)[2:4]) == {}
    assert metric("neuralcache_cache_corrupt_blocks_total") == corrupt + 2
    assert cache.held_keys() == []  # the whole extent, not just the two asked for
    run(cache.flush)
    assert cache.store.extents() == [] and cache.store.index() == []
    cache.close()


def test_a_read_inside_an_extent_is_served_on_the_loop_while_its_pages_are_in_ram(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random 16 KiB read of a cache filled in order: one look-up of the extent's place and
    one residency check, on the event loop. With the pages out it goes to the reader thread,
    and a damaged extent is refused, as the general way does."""
    store, blocks = _written(tmp_path, 32, [0, 16])
    store.close()
    cache = open_cache(tmp_path, 64 * BLOCK_SIZE)
    # The batch's stamp rows say where the values lie: the cache knows it from the mount.
    assert cache.keys.key(*FILE, 16) in cache._addresses
    inline, thread = metric(RUN_READS, {"path": "inline"}), metric(RUN_READS, THREAD)
    general = cache.store.read_run_resident

    def not_this_way(*args: object) -> None:
        raise AssertionError("a read inside a stored extent took the general way")
    monkeypatch.setattr(cache.store, "read_run_resident", not_this_way)
    for first, count in [(20, 4), (16, 16), (31, 1)]:
        assert run(cache.read_run, *FILE, first, count) == _joined(blocks, first, count)
    assert metric(RUN_READS, {"path": "inline"}) == inline + 3
    assert metric(RUN_READS, THREAD) == thread
    monkeypatch.setattr(cache.store, "read_run_resident", general)

    probe = ResidencyProbe()
    extent = cache._addresses[cache.keys.key(*FILE, 16)]
    evict(tmp_path / "data.mdb", [(extent, EXTENT_VALUE_BYTES)])
    if probe.stretch_resident(extent, EXTENT_VALUE_BYTES):
        pytest.skip("this filesystem keeps the file in the page cache")
    assert run(cache.read_run, *FILE, 20, 4) == _joined(blocks, 20, 4)
    assert metric(RUN_READS, THREAD) == thread + 1

    with cache.store.env.begin(write=True) as txn:
        txn.put(BlockKey(*FILE, 16).pack(), b"y" * 24, db=cache.store._extent_tails)
    assert run(cache.read_run, *FILE, 20, 4) is None  # get_many then drops it
    cache.close()


def test_a_page_in_asks_for_each_stored_extent_whole_and_other_blocks_one_by_one(
        tmp_path: Path) -> None:
    """A window over two stored extents and blocks stored on their own: each extent's value
    by its place, as one stretch (its blocks lie inside it), and each other block's own."""
    store, _ = _written(tmp_path, 48, [0, 16])  # blocks 32-47 on their own
    store.close()
    cache = open_cache(tmp_path, 96 * BLOCK_SIZE)
    cache._probe = AlwaysOut()
    try:
        def place(block: int) -> int:
            return cache._addresses[cache.keys.key(*FILE, block)]
        wanted = cache.pages_to_read([(*FILE, 4, 40)])
        assert wanted is not None and wanted.blocks == 36  # the window's blocks 4-39
        assert wanted.spans == merged_spans(
            [(place(0), EXTENT_VALUE_BYTES), (place(16), EXTENT_VALUE_BYTES)]
            + [(place(b), VALUE_BYTES) for b in range(32, 40)])
    finally:
        cache.close()


EXTENT_RUNS = 4
"""Extents of the machine's one file: 64 blocks."""


class ExtentMachine(RuleBasedStateMachine):
    """Runs put whole (maybe forming extents) or block by block, evictions (capacity: 40
    blocks), drops, reads of any run, flushes and reopens; every byte read is the model's."""

    CAPACITY = 40 * BLOCK_SIZE

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="nc-extents-")
        self.cache = open_cache(self.dir, self.CAPACITY)
        self.model: dict[BlockKey, bytes] = {}

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir)

    @rule(first=st.integers(0, EXTENT_RUNS * EXTENT_BLOCKS - 1), count=st.integers(1, 40),
          seed=st.integers(0, 3), short_last=st.booleans())
    def put_run(self, first: int, count: int, seed: int, short_last: bool) -> None:
        count = min(count, EXTENT_RUNS * EXTENT_BLOCKS - first)
        keys = [BlockKey(*FILE, b) for b in range(first, first + count)]
        datas = [block_bytes(k, BLOCK_SIZE, seed) for k in keys]
        if short_last:
            datas[-1] = datas[-1][:100]

        async def step() -> None:
            self.cache.put_run(*FILE, first, datas)
        run(step)
        self.model.update(zip(keys, datas))

    @rule()
    def flush(self) -> None:
        run(self.cache.flush)

    @rule(first=st.integers(0, EXTENT_RUNS * EXTENT_BLOCKS - 1), count=st.integers(1, 40))
    def read_run(self, first: int, count: int) -> None:
        count = min(count, EXTENT_RUNS * EXTENT_BLOCKS - first)
        keys = [BlockKey(*FILE, b) for b in range(first, first + count)]
        held = set(self.cache.held_keys())
        whole = run(self.cache.read_run, *FILE, first, count)
        if whole is not None:
            assert whole == b"".join(self.model[k] for k in keys)
        found = run(self.cache.get_many, keys)
        assert set(found) == {k for k in keys if k in held}
        assert all(found[k] == self.model[k] for k in found)

    @rule(block=st.integers(0, EXTENT_RUNS * EXTENT_BLOCKS - 1))
    def drop(self, block: int) -> None:
        key = BlockKey(*FILE, block)
        before = set(self.cache.held_keys())
        self.cache.drop([key])
        gone = before - set(self.cache.held_keys())
        assert key not in self.cache.held_keys()
        # Only the dropped block goes, and the rest of its extent if it was one.
        assert gone <= {BlockKey(*FILE, b) for b in range(extent_of(block),
                                                          extent_of(block) + EXTENT_BLOCKS)}

    @rule()
    def reopen(self) -> None:
        run(self.cache.flush)
        before = self.cache.held_keys()
        self.cache.close()
        self.cache = open_cache(self.dir, self.CAPACITY)
        assert self.cache.held_keys() == before
        assert run(self.cache.get_many, before) == {k: self.model[k] for k in before}

    @invariant()
    def the_held_blocks_fill_the_capacity_counted(self) -> None:
        held = self.cache.held_keys()
        assert self.cache.policy.used == sum(len(self.model[k]) for k in held) <= self.CAPACITY

    @invariant()
    def stored_extents_hold_held_blocks_only(self) -> None:
        held = set(self.cache.held_keys())
        for extent in self.cache._packed:
            keys = [self.cache.keys.block_key(k) for k in range(extent, extent + EXTENT_BLOCKS)]
            assert set(keys) <= held


TestExtents = ExtentMachine.TestCase
TestExtents.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
