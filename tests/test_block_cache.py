"""``BlockCache`` over a real LMDB environment, against a dict of what was put.

The state machine drives puts, reads, flushes (with reads racing the write), purges and
reopens; each step runs in its own ``trio.run`` with the cache object carried across.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import lmdb
import pytest
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from bench.mount_procs import drop_page_cache
from fabric.protocol import CHECKSUM_BYTES
from fuse_mount import block_cache
from fuse_mount.block_cache import READ_AHEAD_BLOCKS, BlockCache
from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.residency import file_resident_bytes
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import metric

CAPACITY = 6 * BLOCK_SIZE
"""Six full blocks: small enough that a few dozen steps evict, large enough to hold several."""

block_keys = st.builds(BlockKey, st.integers(0, 2), st.integers(0, 1), st.integers(0, 5))
block_sizes = st.integers(1, BLOCK_SIZE)


def block_bytes(key: BlockKey, size: int, seed: int) -> bytes:
    """Content that differs per key, size and seed, so a block served for the wrong key shows."""
    pattern = struct.pack(">QQQB", *key, seed)
    return (pattern * (size // len(pattern) + 1))[:size]


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """Run one async step to completion."""
    return trio.run(fn, *args)


def open_cache(path: Path | str, capacity: int = CAPACITY) -> BlockCache:
    return BlockCache(BlockStore(str(path), capacity), capacity)


def fill(cache: BlockCache, keys: list[BlockKey]) -> None:
    """Put a whole block for each key and wait until all are written."""
    async def main() -> None:
        for key in keys:
            cache.put(key, block_bytes(key, BLOCK_SIZE, 0))
        await cache.flush()
    run(main)


class BlockCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="nc-block-cache-")
        self.cache = open_cache(self.dir)
        self.model: dict[BlockKey, bytes] = {}  # the last bytes put for each key

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir)

    def held(self) -> list[BlockKey]:
        return self.cache.held_keys()

    @rule(key=block_keys, size=block_sizes, seed=st.integers(0, 255))
    def put(self, key: BlockKey, size: int, seed: int) -> None:
        before = [k for k in self.held() if k != key]
        data = block_bytes(key, size, seed)

        async def step() -> None:
            self.cache.put(key, data)
        run(step)
        self.model[key] = data
        after = self.held()
        # Exactly the least recently used blocks made room, and the new block is the newest.
        assert after[-1] == key
        evicted = len(before) - (len(after) - 1)
        assert after[:-1] == before[evicted:]

    @rule(keys=st.lists(block_keys, max_size=8, unique=True))
    def get_many(self, keys: list[BlockKey]) -> None:
        before = self.held()
        found = run(self.cache.get_many, keys)
        assert set(found) == {k for k in keys if k in before}
        assert all(found[k] == self.model[k] for k in found)
        # Reading evicts nothing; it only moves what was found to the recent end.
        after = self.held()
        rest = [k for k in before if k not in found]
        assert after[:len(rest)] == rest
        assert set(after[len(rest):]) == set(found)

    @rule(file_id=st.integers(0, 2), version=st.integers(0, 1), first=st.integers(0, 5),
          count=st.integers(1, 4), flushed=st.booleans())
    def read_run(self, file_id: int, version: int, first: int, count: int,
                 flushed: bool) -> None:
        if flushed:
            run(self.cache.flush)
        keys = [BlockKey(file_id, version, b) for b in range(first, first + count)]
        before = self.held()
        whole = run(self.cache.read_run, file_id, version, first, count)
        if whole is None:
            # Only a run not wholly on disk falls back to get_many; reading changed nothing.
            assert not (flushed and all(k in before for k in keys))
            assert self.held() == before
            return
        assert whole == b"".join(self.model[k] for k in keys)
        assert self.held() == [k for k in before if k not in keys] + keys

    @rule()
    def flush_while_reading(self) -> None:
        held = self.held()
        expected = {k: self.model[k] for k in held}

        async def step() -> list[dict[BlockKey, bytes]]:
            seen = []
            flushed = trio.Event()

            async def flush() -> None:
                await self.cache.flush()
                flushed.set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(flush)
                # Read at every scheduling point of the flush: before, during and after the
                # batch moves from memory to the write in progress and on to disk.
                while not flushed.is_set():
                    seen.append(await self.cache.get_many(held))
                    await trio.sleep(0)
            return seen

        assert all(found == expected for found in run(step))

    @rule()
    def reopen(self) -> None:
        run(self.cache.flush)
        before = self.held()
        self.cache.close()
        self.cache = open_cache(self.dir)
        assert self.held() == before  # same blocks, same recency order
        found = run(self.cache.get_many, before)
        assert found == {k: self.model[k] for k in before}

    @rule(file_id=st.integers(0, 2), version=st.none() | st.integers(0, 1))
    def purge(self, file_id: int, version: int | None) -> None:
        def keep(k: BlockKey) -> bool:
            return not (k.file_id == file_id and version in (None, k.version))
        before = self.held()
        assert self.cache.purge(keep) == sum(not keep(k) for k in before)
        assert self.held() == [k for k in before if keep(k)]
        for k in [k for k in self.model if not keep(k)]:
            del self.model[k]

    @rule(keys=st.lists(block_keys, max_size=6))
    def drop(self, keys: list[BlockKey]) -> None:
        before = self.held()
        told: list[BlockKey] = []
        self.cache.watch(told.append, lambda key: False)
        gone = [k for k in before if k in set(keys)]
        assert self.cache.drop(keys) == len(gone)
        assert sorted(told) == sorted(gone)  # the prefetcher hears of every dropped block
        assert self.held() == [k for k in before if k not in set(keys)]
        for k in gone:
            del self.model[k]

    @invariant()
    def used_bytes_match_the_held_blocks(self) -> None:
        held = self.held()
        assert set(held) <= set(self.model)
        used = sum(len(self.model[k]) for k in held)
        assert self.cache.policy.used == used <= CAPACITY
        assert metric("neuralcache_cache_used_bytes") == used

    @invariant()
    def held_blocks_counts_each_file_versions_blocks(self) -> None:
        held = self.held()
        for file_id in range(3):
            for version in range(2):
                assert self.cache.held_blocks(file_id, version) == sum(
                    k.file_id == file_id and k.version == version for k in held)


TestBlockCache = BlockCacheMachine.TestCase
TestBlockCache.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


KEY = BlockKey(7, 3, 0)


def test_blocks_persist_across_a_reopen_in_recency_order(tmp_path: Path) -> None:
    keys = [BlockKey(1, 1, b) for b in range(4)]
    cache = open_cache(tmp_path)

    async def fill_and_use_the_first() -> None:
        for k in keys:
            cache.put(k, block_bytes(k, BLOCK_SIZE, 0))
        await cache.get_many([keys[0]])  # now the most recently used
        await cache.flush()
    run(fill_and_use_the_first)
    cache.close()
    cache = open_cache(tmp_path)
    assert cache.held_keys() == keys[1:] + keys[:1]
    assert run(cache.get_many, keys) == {k: block_bytes(k, BLOCK_SIZE, 0) for k in keys}
    cache.close()


def test_reopen_with_a_smaller_capacity_keeps_the_most_recent(tmp_path: Path) -> None:
    keys = [BlockKey(1, 1, b) for b in range(4)]
    cache = open_cache(tmp_path)
    fill(cache, keys)
    cache.close()
    cache = open_cache(tmp_path, capacity=2 * BLOCK_SIZE)
    assert cache.held_keys() == keys[2:]
    run(cache.flush)  # writes the deletions of what did not fit
    cache.close()
    cache = open_cache(tmp_path)
    assert cache.held_keys() == keys[2:]
    cache.close()


def test_the_background_writer_persists_puts(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    data = block_bytes(KEY, 100, 1)
    batches = metric("neuralcache_cache_write_batch_seconds_count")
    ops = metric("neuralcache_cache_write_batch_ops_sum")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run_writer)
            cache.put(KEY, data)
            with trio.fail_after(5):
                while not cache.store.index():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    run(main)
    assert cache.store.get_many([KEY]) == ({KEY: data}, [])
    assert metric("neuralcache_cache_write_batch_seconds_count") == batches + 1
    assert metric("neuralcache_cache_write_batch_ops_sum") == ops + 1
    cache.close()


def test_the_stamps_of_a_read_only_mount_are_written_as_they_pile_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hits put nothing, so their last-use stamps ride along with no batch: past
    ``STAMPS_PENDING_MAX`` the writer writes them on its own, ``MAX_BATCH_STAMPS`` at a time and
    batch after batch (no gathering for ``FLUSH_INTERVAL`` meanwhile: it could not keep up),
    so they neither pile up in memory nor wait for the unmount."""
    monkeypatch.setattr(block_cache, "STAMPS_PENDING_MAX", 8)
    monkeypatch.setattr(block_cache, "MAX_BATCH_STAMPS", 4)
    monkeypatch.setattr(block_cache, "FLUSH_INTERVAL", 60.0)  # longer than the test may wait
    keys = [BlockKey(1, 1, b) for b in range(32)]
    capacity = len(keys) * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    fill(cache, keys)
    batches = metric("neuralcache_cache_write_batch_seconds_count")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run_writer)
            for key in reversed(keys):  # newest first: the reverse of the order they were put
                assert await cache.read_run(*key, 1) == block_bytes(key, BLOCK_SIZE, 0)
            with trio.fail_after(30):  # a bound on a hang; 60 s of gathering would pass it
                while cache._pending_stamps() >= 8:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    run(main)
    assert metric("neuralcache_cache_write_batch_seconds_count") >= batches + (32 - 7) // 4
    cache.close()  # no flush: what is on disk is what the writer wrote while reads went on
    reopened = open_cache(tmp_path, capacity)
    order = reopened.held_keys()
    reopened.close()
    # Blocks whose new stamps were written are the most recent, in the order they were read;
    # the few left pending keep the order they were put in.
    assert any(order == keys[:left] + keys[left:][::-1] for left in range(8))


def test_runs_read_whole_are_stamped_as_if_block_by_block(tmp_path: Path) -> None:
    """A run read whole keeps its stamps as one entry until they are written; a touch, a drop
    or a put in between must still see them in read order, and the order survives a remount.
    (From block 1: no extent, whose blocks would be dropped with block 11.)"""
    keys = [BlockKey(1, 1, b) for b in range(1, 17)]
    capacity = len(keys) * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    fill(cache, keys)

    async def main() -> None:
        assert await cache.read_run(1, 1, 1, 8) is not None
        assert set(await cache.get_many([keys[3]])) == {keys[3]}  # stamped after the run
        assert await cache.read_run(1, 1, 9, 8) is not None
        assert cache.drop([keys[10]]) == 1
        assert await cache.read_run(1, 1, 5, 2) is not None  # read again: newest
        await cache.flush()

    run(main)
    expected = [keys[i].block for i in [0, 1, 2, 6, 7, 3, 8, 9, 11, 12, 13, 14, 15, 4, 5]]
    assert [k.block for k in cache.held_keys()] == expected
    cache.close()
    reopened = open_cache(tmp_path, capacity)
    assert [k.block for k in reopened.held_keys()] == expected
    reopened.close()


def test_a_put_is_written_with_its_stamp_however_many_others_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is read from the stamp rows alone: a block written without its row would
    never be counted, nor evicted, again. A batch's puts carry their rows whatever the bound
    on the other stamps it takes."""
    monkeypatch.setattr(block_cache, "MAX_BATCH_STAMPS", 2)
    old = [BlockKey(1, 1, b) for b in range(8)]
    new = [BlockKey(2, 1, b) for b in range(2)]
    capacity = (len(old) + len(new)) * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    fill(cache, old)

    async def main() -> None:
        for key in old:  # eight stamps wait, ahead of the puts'
            assert await cache.read_run(*key, 1) is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run_writer)
            for key in new:
                cache.put(key, block_bytes(key, BLOCK_SIZE, 0))
            with trio.fail_after(30):
                while cache.store.get_many(new)[0].keys() != set(new):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    run(main)
    cache.close()  # no flush
    reopened = open_cache(tmp_path, capacity)
    held = reopened.held_keys()
    reopened.close()
    assert set(held) == set(old + new)


def test_a_put_evicted_while_its_batch_is_written_keeps_its_stamp_row(tmp_path: Path) -> None:
    """Stamp rows are made in the thread that hands a batch to the writer, after the event loop
    took the batch: a block the loop evicted meanwhile is still put by this batch, so its row
    must go with it (its delete follows in the next batch), or a crash between the two would
    leave a block no index ever counts again."""
    cache = open_cache(tmp_path)
    key = cache.keys.key(*KEY)
    data = block_bytes(KEY, 100, 0)
    cache._write_batch({key: data}, [], {key: 5})  # the key was never held: "evicted"
    assert [(e.key, e.size, e.stamp) for e in cache.store.index()] == [(tuple(KEY), 100, 5)]
    cache.close()


def _write_raw(path: Path, key: BlockKey, value: Callable[[bytes], bytes]) -> None:
    """Rewrite one stored value behind the cache's back, as disk damage would."""
    env = lmdb.open(str(path), max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        txn.put(key.pack(), value(bytes(txn.get(key.pack()))))
    env.close()


def _flip_data_byte(raw: bytes) -> bytes:
    damaged = bytearray(raw)
    damaged[CHECKSUM_BYTES + 10] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize("damage", [_flip_data_byte, lambda raw: b"garbage", lambda raw: b""],
                         ids=["flipped-byte", "garbage", "empty"])
def test_a_corrupted_stored_block_is_dropped_not_served(
        tmp_path: Path, damage: Callable[[bytes], bytes]) -> None:
    other = BlockKey(7, 3, 1)
    cache = open_cache(tmp_path)
    fill(cache, [KEY, other])
    cache.close()
    _write_raw(tmp_path, KEY, damage)

    cache = open_cache(tmp_path)
    corrupt_before = metric("neuralcache_cache_corrupt_blocks_total")
    # The range read refuses the run and leaves the damage to get_many, which finds it.
    assert run(cache.read_run, KEY.file_id, KEY.version, KEY.block, 2) is None
    assert run(cache.get_many, [KEY, other]) == {other: block_bytes(other, BLOCK_SIZE, 0)}
    assert metric("neuralcache_cache_corrupt_blocks_total") == corrupt_before + 1
    assert not cache.holds(KEY)
    assert cache.policy.used == metric("neuralcache_cache_used_bytes") == BLOCK_SIZE
    run(cache.flush)
    cache.close()
    cache = open_cache(tmp_path)  # the damaged block was deleted from disk too
    assert cache.held_keys() == [other]
    cache.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs: room for LMDB's own pages and a few blocks, not for a hundred more."""
    path = tmp_path / "small-disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def kill_writer(cache: BlockCache) -> None:
    """SIGKILL the cache's writer process and wait until it is gone."""
    pid = cache.writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@pytest.mark.parametrize("failure", ["disk full", "writer killed"])
def test_a_failed_write_is_counted_and_its_blocks_are_not_held(
        tmp_path: Path, small_disk: Path, failure: str) -> None:
    """A batch the writer cannot write (the disk is full, or the writer process died) is
    counted and its blocks forgotten, to be fetched again; blocks written before stay."""
    cache = open_cache(small_disk if failure == "disk full" else tmp_path, 1024 * BLOCK_SIZE)
    kept = BlockKey(1, 1, 0)

    async def fill_and_flush(keys: list[BlockKey]) -> None:
        for k in keys:
            cache.put(k, block_bytes(k, BLOCK_SIZE, 0))
        await cache.flush()
    run(fill_and_flush, [kept])
    if failure == "writer killed":
        kill_writer(cache)
    errors_before = metric("neuralcache_cache_write_errors_total")
    lost = [BlockKey(2, 1, b) for b in range(200)]
    run(fill_and_flush, lost)
    assert metric("neuralcache_cache_write_errors_total") == errors_before + 1
    assert cache.held_keys() == [kept]
    assert cache.policy.used == BLOCK_SIZE
    assert run(cache.get_many, [kept, *lost]) == {kept: block_bytes(kept, BLOCK_SIZE, 0)}
    if failure == "writer killed":  # the next batch starts a new writer
        again = BlockKey(3, 1, 0)
        run(fill_and_flush, [again])
        assert cache.held_keys() == [kept, again]
    cache.close()
    if failure == "writer killed":
        reopened = open_cache(tmp_path)
        assert reopened.held_keys() == [kept, again]
        reopened.close()


def test_the_next_batch_deletes_what_a_failed_one_left_in_lmdb(tmp_path: Path) -> None:
    """A batch lost with its writer took the deletes of the blocks it evicted with it: the
    next batch makes them, so the cache file holds no block the cache does not count."""
    cache = open_cache(tmp_path, 4 * BLOCK_SIZE)
    a, b, c, d, e, f, g = (BlockKey(1, 1, n) for n in range(7))
    fill(cache, [a, b, c, d])
    kill_writer(cache)
    fill(cache, [e, f])  # evicts a and b; the batch fails, e and f are forgotten
    assert cache.held_keys() == [c, d]
    fill(cache, [g])  # a new writer
    cache.close()
    reopened = open_cache(tmp_path, 4 * BLOCK_SIZE)
    assert reopened.held_keys() == [c, d, g]  # not a or b, not e or f
    reopened.close()


@pytest.mark.parametrize("method", ["get_many", "read_run"])
def test_a_block_purged_during_its_disk_read_leaves_no_stamp_behind(
        tmp_path: Path, method: str) -> None:
    """A read that finds a block on disk after it was purged must not record a last-use stamp
    for it: nothing would ever delete that stamp row again."""
    cache = open_cache(tmp_path)
    cache.inline_max_blocks = 0  # the race needs the reader thread (inline reads never wait)
    read_store = getattr(cache.store, method)
    token: list[trio.lowlevel.TrioToken] = []

    async def purge_and_flush() -> None:
        cache.purge(lambda k: k != KEY)
        await cache.flush()

    def read_then_purge(*args: Any) -> Any:
        found = read_store(*args)
        # The cache's reader thread is not a trio worker thread: name the loop to call back.
        trio.from_thread.run(purge_and_flush, trio_token=token[0])
        return found

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())
        cache.put(KEY, block_bytes(KEY, 10, 0))
        await cache.flush()
        setattr(cache.store, method, read_then_purge)
        if method == "get_many":
            assert await cache.get_many([KEY]) == {KEY: block_bytes(KEY, 10, 0)}
        else:
            assert await cache.read_run(*KEY, 1) == block_bytes(KEY, 10, 0)
        await cache.flush()
    run(main)
    stamps = cache.store.env.open_db(b"stamps")
    with cache.store.env.begin(db=stamps) as txn:
        assert txn.get(KEY.pack()) is None
    assert cache.store.index() == []
    cache.close()


def test_held_keys_are_left_alone_by_the_garbage_collector(tmp_path: Path) -> None:
    """One key per cached block lives as long as the block: if the collector followed them, a
    large cache would make every full collection a long pause of the event loop."""
    cache = open_cache(tmp_path / "c")
    run(_put_and_flush, cache, [BlockKey(1, 7, b) for b in range(8)])
    cache.close()
    cache = open_cache(tmp_path / "c")  # the index loaded from disk
    run(_put_and_flush, cache, [BlockKey(2, 7, b) for b in range(8)])  # and fresh puts
    gc.collect()
    held = list(cache.policy.oldest_first())  # the cache's own keys, not the BlockKeys it shows
    assert len(held) == 16
    assert not any(gc.is_tracked(k) for k in held)
    cache.close()


async def _put_and_flush(cache: BlockCache, keys: list[BlockKey]) -> None:
    for key in keys:
        cache.put(key, block_bytes(key, 100, 0))
    await cache.flush()


def test_opening_a_filled_cache_reads_no_block_from_disk(tmp_path: Path) -> None:
    """The index comes from the stamp table alone: a mount over a large warm cache must not
    read the cache file (stepping over the blocks read a page of every value)."""
    keys = [BlockKey(1, 1, b) for b in range(2048)]  # 8 MiB of blocks, two pages each
    capacity = 2 * len(keys) * BLOCK_SIZE
    cache = open_cache(tmp_path, capacity)
    cache.put(BlockKey(2, 1, 0), b"short")  # a file's last block: its size is kept too
    fill(cache, keys)
    cache.close()
    data_file = tmp_path / "data.mdb"
    drop_page_cache(data_file)
    if file_resident_bytes(data_file) > os.path.getsize(data_file) // 2:
        pytest.skip("this filesystem keeps the file in the page cache")
    cache = open_cache(tmp_path, capacity)
    try:
        assert len(cache.policy) == len(keys) + 1
        assert cache.policy.used == len(keys) * BLOCK_SIZE + len(b"short")
        assert file_resident_bytes(data_file) < 1024 * 1024  # of a 16 MiB file
    finally:
        cache.close()


def wait_resident(path: Path, nbytes: int = 512 * BLOCK_SIZE, timeout: float = 10) -> bool:
    """Wait until ``nbytes`` of the file are in the page cache (the kernel reads in the
    background after ``MADV_WILLNEED``)."""
    deadline = time.monotonic() + timeout
    while file_resident_bytes(path) < nbytes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def reopened_on_disk(path: Path, keys: list[BlockKey]) -> tuple[BlockCache, Path]:
    """A cache holding ``keys``, closed, its file evicted from the page cache, and opened again
    (skips the test where the filesystem keeps the file in RAM); and the cache file."""
    cache = open_cache(path, 4 * len(keys) * BLOCK_SIZE)
    fill(cache, keys)
    cache.close()
    data_file = path / "data.mdb"
    drop_page_cache(data_file)
    if file_resident_bytes(data_file) > 1024 * 1024:
        pytest.skip("this filesystem keeps the file in the page cache")
    return open_cache(path, 4 * len(keys) * BLOCK_SIZE), data_file


def test_a_read_going_forward_through_a_cache_on_disk_has_the_blocks_after_it_read_too(
        tmp_path: Path) -> None:
    keys = [BlockKey(1, 1, b) for b in range(1024)]  # 4 MiB of blocks
    cache, data_file = reopened_on_disk(tmp_path, keys)
    paged = metric("neuralcache_cache_page_in_blocks_total")

    def expected(first: int, count: int) -> bytes:
        return b"".join(block_bytes(k, BLOCK_SIZE, 0) for k in keys[first:first + count])
    try:
        # No read ended where this one starts: a random reader, nothing more is asked for.
        # (It reads its extent, blocks 496-511, whole.)
        assert run(cache.read_run, 1, 1, 508, 4) == expected(508, 4)
        assert metric("neuralcache_cache_page_in_blocks_total") == paged
        # The next read continues it, and its first page is on the disk: it and the (up to
        # 2048) held blocks after it are asked for.
        assert run(cache.read_run, 1, 1, 512, 4) == expected(512, 4)
        assert metric("neuralcache_cache_page_in_blocks_total") == paged + len(keys) - 512
        assert wait_resident(data_file, 520 * BLOCK_SIZE)  # read in the page-in thread
        inline = metric("neuralcache_cache_run_reads_total", {"path": "inline"})
        assert run(cache.read_run, 1, 1, 800, 32) == expected(800, 32)
        assert metric("neuralcache_cache_run_reads_total", {"path": "inline"}) == inline + 1
    finally:
        cache.close()


def read_forward(cache: BlockCache, keys: list[BlockKey], first: int, stop: int) -> None:
    """Read blocks ``[first, stop)`` of file 1 as one run and check their bytes."""
    assert run(cache.read_run, 1, 1, first, stop - first) == b"".join(
        block_bytes(k, BLOCK_SIZE, 0) for k in keys[first:stop])


def wait_paged_in(cache: BlockCache, first: int, stop: int) -> None:
    """Wait until blocks ``[first, stop)`` of file 1 are all in RAM."""
    deadline = time.monotonic() + 10
    while cache.pages_to_read([(1, 1, first, stop)]) is not None:
        assert time.monotonic() < deadline, "the pages never all came in"
        time.sleep(0.05)


def test_a_read_going_forward_has_the_next_stretch_read_while_half_the_last_is_unread(
        tmp_path: Path) -> None:
    """A reader going forward through a cache on disk in runs the reader thread reads: once
    the block half a read-ahead past a run's end is on the disk, the run and the read-ahead
    after it are asked for, before the reader reaches a page that is not in RAM."""
    keys = [BlockKey(1, 1, b) for b in range(4 * READ_AHEAD_BLOCKS)]
    cache, data_file = reopened_on_disk(tmp_path, keys)
    half = READ_AHEAD_BLOCKS // 2

    def forward(first: int, stop: int) -> None:
        read_forward(cache, keys, first, stop)
    try:
        forward(0, 4)  # where a reader starts: nothing more is asked for
        paged = metric("neuralcache_cache_page_in_blocks_total")
        forward(4, 104)  # goes on, and the block `half` past it is on the disk
        assert metric("neuralcache_cache_page_in_blocks_total") == (
            paged + 104 + READ_AHEAD_BLOCKS - 4)
        wait_paged_in(cache, 4, 104 + READ_AHEAD_BLOCKS)
        paged = metric("neuralcache_cache_page_in_blocks_total")
        forward(104, 360)  # half a read-ahead on from each of these is in RAM: nothing asked
        forward(360, 616)
        assert metric("neuralcache_cache_page_in_blocks_total") == paged
        stop = 104 + READ_AHEAD_BLOCKS - half + 100  # `half` past it lies beyond what came in
        forward(616, stop)
        assert metric("neuralcache_cache_page_in_blocks_total") == (
            paged + stop + READ_AHEAD_BLOCKS - 616)
    finally:
        cache.close()


def test_a_read_going_forward_has_the_blocks_just_after_it_read_when_further_ones_are_in_ram(
        tmp_path: Path) -> None:
    """Something else (a prefetch window's page-in) read in the blocks half a read-ahead past
    a run while the ones just after it are still on the disk: the read-ahead still asks for
    them, rather than take the blocks further on as a sign it already had."""
    keys = [BlockKey(1, 1, b) for b in range(2 * READ_AHEAD_BLOCKS)]
    cache, _ = reopened_on_disk(tmp_path, keys)
    far = 104 + READ_AHEAD_BLOCKS // 2  # half a read-ahead past block 104
    try:
        read_forward(cache, keys, 0, 4)  # where a reader starts: nothing more is asked for
        wanted = cache.pages_to_read([(1, 1, far - 64, far + 64)])
        assert wanted is not None
        run(cache.page_in, wanted)
        wait_paged_in(cache, far - 64, far + 64)
        assert cache.pages_to_read([(1, 1, 104, 105)]) is not None  # block 104: on the disk
        paged = metric("neuralcache_cache_page_in_blocks_total")
        read_forward(cache, keys, 4, 104)
        assert metric("neuralcache_cache_page_in_blocks_total") == (
            paged + 104 + READ_AHEAD_BLOCKS - 4)
    finally:
        cache.close()


def test_page_in_reads_a_runs_values_into_ram_ahead_of_its_reads(tmp_path: Path) -> None:
    keys = [BlockKey(1, 1, b) for b in range(1024)]  # 4 MiB of blocks
    cache, data_file = reopened_on_disk(tmp_path, keys)
    paged = metric("neuralcache_cache_page_in_blocks_total")
    try:
        wanted = cache.pages_to_read([(1, 1, 256, 768), (1, 2, 0, 10), (7, 1, 0, 10)])
        assert wanted is not None and wanted.blocks == 512  # the held blocks' values only
        run(cache.page_in, wanted)
        assert metric("neuralcache_cache_page_in_blocks_total") == paged + 512
        assert wait_resident(data_file)  # the kernel reads them in the background
        deadline = time.monotonic() + 10
        # Once the kernel has read them all in, they are not asked for again.
        while cache.pages_to_read([(1, 1, 256, 768)]) is not None:
            assert time.monotonic() < deadline, "the pages never all came in"
            time.sleep(0.05)

        async def read() -> bytes | None:
            return await cache.read_run(1, 1, 300, 32)
        inline = metric("neuralcache_cache_run_reads_total", {"path": "inline"})
        assert run(read) == b"".join(block_bytes(k, BLOCK_SIZE, 0) for k in keys[300:332])
        assert metric("neuralcache_cache_run_reads_total", {"path": "inline"}) == inline + 1
    finally:
        cache.close()
