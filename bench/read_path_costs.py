"""Where a warm read's time goes inside the spoke, without FUSE: the parts of ``BlockFetcher.read``.

    python -m bench.read_path_costs [--blocks 16384] [--workdir DIR]

Writes ``--blocks`` random 4 KiB blocks into a fresh ``BlockStore`` (LMDB) the way the daemon's
writer does, then times in this one process, with the LMDB file in the page cache (so what is
measured is CPU, as in the warm rows of ``bench.throughput``):

- the round trip to a thread and back for a no-op: ``trio.to_thread.run_sync`` and the
  cache's own ``JobThreads`` (which every LMDB read of the cache goes through), left on any
  CPU and, as the cache runs it, bound to the event loop's CPU;
- ``BlockStore.get_many`` (a ``get`` and a copy per block) and ``BlockStore.read_run`` (one
  cursor walk, one join), called directly, for 256 blocks (one 1 MiB FUSE read) and 4 (16 KiB);
- ``BlockStore.read_run_resident`` (the same after a ``mincore`` check of the values' pages),
  and that check alone;
- ``BlockCache.pages_to_read`` of the whole store as one run, as a prefetch window's page-in
  asks on the event loop (64 MiB at the default size: where each value lies, and a ``mincore``
  check that finds them all in RAM);
- ``BlockCache.read_run`` and ``BlockCache.get_many``: the same through the cache (LRU and
  last-use stamps), ``read_run`` both on the event loop (inline, as the cache serves runs of
  pages in RAM up to its limit) and through its reader thread, with the event loop's thread
  left where the scheduler puts it (as in the daemon) and bound to one CPU;
- ``BlockFetcher.read`` of 1 MiB and 16 KiB, every block a hit, cache writer running as in the
  daemon (it persists the stamps those hits leave);
- a prefetch from ``BlockFetcher.start_prefetch`` until its blocks are in the cache, with a
  stand-in hub client that answers right after the call, as the real one answers later (the
  fetcher's and the cache's bookkeeping of
  fetching, no network, no writes: the writer is not running), for 64 blocks and 4;
- for comparison, ``BlockStore.read_run`` of the same bytes stored block by block, as the
  spoke stores blocks that did not land in a batch with the rest of their extent (the store
  above holds them as extents, 16 blocks in one LMDB value, as the spoke does with whole
  aligned runs landed together, and as it stored nothing before session 51).

Each figure is the best of REPEATS runs (the least disturbed by the other users of the two
cores), in microseconds per call, with the MB/s that cost alone would allow.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

import numpy as np
import trio

from fabric.job_threads import JobThreads
from fabric.protocol import MetaEntry
from fuse_mount.block_cache import INLINE_MAX_BLOCKS, BlockCache
from fuse_mount.block_store import (EXTENT_BLOCKS, EXTENT_BYTES, VALUE_BYTES, BlockKey, BlockStore,
                                    extent_of)
from fuse_mount.residency import ResidencyProbe
from fuse_mount.fetcher import BlockFetcher
from neuralcache.blocks import BLOCK_SIZE

DEFAULT_BLOCKS = 16384
"""64 MiB of blocks: enough keys that lookups walk a real B-tree, quick to write."""
REPEATS = 3
MIB_BLOCKS = 256
"""Blocks in one 1 MiB FUSE read (the mount's readahead size)."""
SMALL_BLOCKS = 4
"""Blocks in one 16 KiB random read."""
WRITE_BATCH = 4096
FILE_ID, VERSION = 1, 1


LANDING_BLOCKS = 64
"""Blocks in the larger prefetch landed (256 KiB, a sequential reader's typical fetch)."""


class _InstantHub:
    """Stands in for the hub client of a prefetch: ``answer`` hands back the bytes of every
    prefetch started since, in one part (later, as the client does, never inside
    ``start_prefetch``)."""

    def __init__(self) -> None:
        self._data = bytes(LANDING_BLOCKS * BLOCK_SIZE)
        self._asked: list[tuple[int, Callable[[list[bytes] | BaseException], None]]] = []

    def start_prefetch(self, file_id: int, version: int, first: int, count: int, *,
                       deadline: float,
                       on_done: Callable[[list[bytes] | BaseException], None]) -> None:
        self._asked.append((count, on_done))

    def answer(self) -> None:
        for count, on_done in self._asked:
            on_done([self._data[:count * BLOCK_SIZE]])
        self._asked.clear()


class _NoHub:
    """Stands in for the hub client: every block is cached, so a call is a bug."""

    async def read(self, *args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("a warm read asked the hub")


def _best(run: Callable[[int], Any], calls: int) -> float:
    """Best mean seconds per call over REPEATS runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for i in range(calls):
            run(i)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


async def _best_async(run: Callable[[int], Awaitable[Any]], calls: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for i in range(calls):
            await run(i)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def _row(label: str, seconds: float, nbytes: int | None) -> str:
    rate = f"{nbytes / seconds / 1e6:>9.0f} MB/s" if nbytes else ""
    return f"{label:<58}{seconds * 1e6:>9.1f} us{rate}"


def _fill_store(path: str, blocks: int, data: bytes, extents: bool) -> BlockStore:
    store = BlockStore(path, blocks * BLOCK_SIZE * 2)
    for start in range(0, blocks, WRITE_BATCH):
        end = min(start + WRITE_BATCH, blocks)
        puts = {BlockKey(FILE_ID, VERSION, b): data[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]
                for b in range(start, end)}
        firsts = range(start, end, EXTENT_BLOCKS) if extents else []
        placed = store.write_batch(puts, [], {}, [BlockKey(FILE_ID, VERSION, b)
                                                  for b in firsts]).addresses
        # As the daemon's writer does: the stamp rows, with where each value lies, follow.
        store.write_batch({}, [], {k: (0, BLOCK_SIZE, a) for k, a in placed.items()})
    return store


async def _cache_runs(cache: BlockCache, path: str, inline_max_blocks: int,
                      run_mib: Callable[[int], Awaitable[Any]],
                      run_small: Callable[[int], Awaitable[Any]]) -> list[str]:
    """``BlockCache.read_run`` of 256 and 4 blocks with the inline limit set to
    ``inline_max_blocks``: all on the event loop, or all through the reader thread."""
    cache.inline_max_blocks = inline_max_blocks
    return [_row(f"BlockCache.read_run, 256 blocks, {path}", await _best_async(run_mib, 300),
                 1 << 20),
            _row(f"BlockCache.read_run, 4 blocks, {path}", await _best_async(run_small, 3000),
                 16384)]


async def _bound_loop_runs(cache: BlockCache, run_mib: Callable[[int], Awaitable[Any]],
                           run_small: Callable[[int], Awaitable[Any]]) -> list[str]:
    """The reader thread's rows again with the loop's thread bound to one CPU. The reader
    thread follows the loop's CPU; a loop left free is woken on the idle CPU while the thread
    still holds its own, and takes the thread along at the next job: the difference between
    the two is what those moves cost (docs/throughput.md, session 63)."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        return await _cache_runs(cache, "reader thread, loop bound", 0, run_mib, run_small)
    finally:
        os.sched_setaffinity(0, allowed)


async def _landing_rows(workdir: str) -> list[str]:
    """Prefetches of 64 and 4 blocks, each of blocks not cached yet, into a cache of their own
    (large enough that nothing is evicted)."""
    calls = {LANDING_BLOCKS: 200, SMALL_BLOCKS: 2000}
    room = REPEATS * sum(count * n for count, n in calls.items()) * BLOCK_SIZE
    cache = BlockCache(BlockStore(os.path.join(workdir, "landing.lmdb"), 2 * room), 2 * room)
    entry = MetaEntry("landing.bin", "f", 0o444, room, 0, FILE_ID + 1, VERSION)
    cursor = [0]  # the file's first block not prefetched yet
    landed: list[bool] = []
    try:
        async with trio.open_nursery() as nursery:
            hub = _InstantHub()
            fetcher = BlockFetcher(cache, hub, nursery,  # type: ignore[arg-type]
                                   hub_timeout=60.0)

            def land(count: int) -> Callable[[int], None]:
                def one(i: int) -> None:
                    first, cursor[0] = cursor[0], cursor[0] + count
                    fetcher.start_prefetch(entry, first, count, landed.append)
                    hub.answer()
                return one
            rows = [_row(f"BlockFetcher.start_prefetch to landed, {count} blocks, no hub",
                         _best(land(count), n), count * BLOCK_SIZE)
                    for count, n in calls.items()]
            nursery.cancel_scope.cancel()
        assert landed == [True] * REPEATS * sum(calls.values()), "a prefetch did not land"
    finally:
        cache.close()
    return rows


async def _measure(cache: BlockCache, loose: BlockStore, blocks: int) -> list[str]:
    store = cache.store
    entry = MetaEntry("data.bin", "f", 0o444, blocks * BLOCK_SIZE, 0, FILE_ID, VERSION)
    runs = blocks // MIB_BLOCKS
    slots = blocks // SMALL_BLOCKS
    spread = 977  # a stride coprime to the slot count walks the file in scattered order

    def keys(first: int, count: int) -> list[BlockKey]:
        return [BlockKey(FILE_ID, VERSION, b) for b in range(first, first + count)]

    def mib(i: int) -> int:
        return (i % runs) * MIB_BLOCKS

    def mid_extent(i: int) -> int:
        """The offset of a 1 MiB read from the middle of an extent, as a data loader's reads
        start at its samples: the run is read with the whole of the extents at its ends."""
        return mib(i % (runs - 1)) * BLOCK_SIZE + EXTENT_BYTES // 2

    def small(i: int) -> int:
        return (i * spread % slots) * SMALL_BLOCKS

    probe = ResidencyProbe()

    def addresses(first: int, count: int) -> list[int]:
        return [cache._addresses[k] for k in cache.keys.run(FILE_ID, VERSION, first, count)]

    def extents(first: int, count: int) -> list[int]:
        """The extents that hold a run (every block of the store is in one)."""
        return list(range(extent_of(first), first + count, EXTENT_BLOCKS))

    def read_run(first: int, count: int) -> bytes | None:
        return store.read_run(FILE_ID, VERSION, first, count, extents=extents(first, count))

    def resident(first: int, count: int) -> bytes | None:
        wide = extents(first, count)
        span = addresses(wide[0], max(first + count, wide[-1] + EXTENT_BLOCKS) - wide[0])
        found = store.read_run_resident(FILE_ID, VERSION, first, count, span, probe, wide)
        assert found is not None, "the store's pages are not all in the page cache"
        return found

    def run_mib(i: int) -> Awaitable[bytes | None]:
        return cache.read_run(FILE_ID, VERSION, mib(i), MIB_BLOCKS)

    def run_small(i: int) -> Awaitable[bytes | None]:
        return cache.read_run(FILE_ID, VERSION, small(i), SMALL_BLOCKS)

    reader, unpinned = JobThreads(), JobThreads(follow_loop_cpu=False)
    rows = [_row("trio.to_thread.run_sync(no-op) round trip",
                 await _best_async(lambda i: trio.to_thread.run_sync(lambda: None), 2000), None),
            _row("JobThreads.run(no-op) round trip, thread on any CPU",
                 await _best_async(lambda i: unpinned.run(lambda: None), 2000), None),
            _row("JobThreads.run(no-op) round trip, on the loop's CPU",
                 await _best_async(lambda i: reader.run(lambda: None), 2000), None),
            _row("BlockStore.get_many, 256 keys, direct",
                 _best(lambda i: store.get_many(keys(mib(i), MIB_BLOCKS)), 200), 1 << 20),
            _row("BlockStore.get_many, 4 keys, direct",
                 _best(lambda i: store.get_many(keys(small(i), SMALL_BLOCKS)), 5000), 16384),
            _row("BlockStore.read_run, 256 blocks, direct",
                 _best(lambda i: read_run(mib(i), MIB_BLOCKS), 300), 1 << 20),
            _row("BlockStore.read_run, 4 blocks, direct",
                 _best(lambda i: read_run(small(i), SMALL_BLOCKS), 5000), 16384),
            _row("BlockStore.read_run_resident, 256 blocks, direct",
                 _best(lambda i: resident(mib(i), MIB_BLOCKS), 300), 1 << 20),
            _row("BlockStore.read_run_resident, 4 blocks, direct",
                 _best(lambda i: resident(small(i), SMALL_BLOCKS), 5000), 16384),
            _row("ResidencyProbe.all_resident, 4 blocks (mincore)",
                 _best(lambda i: probe.all_resident(addresses(small(i), SMALL_BLOCKS),
                                                    VALUE_BYTES), 5000), None),
            _row("BlockCache.pages_to_read, the whole store as one window",
                 _best(lambda i: cache.pages_to_read([(FILE_ID, VERSION, 0, blocks)]), 50),
                 None)]
    reader.close()
    unpinned.close()
    rows += [_row("BlockCache.get_many, 256 keys",
                  await _best_async(lambda i: cache.get_many(keys(mib(i), MIB_BLOCKS)), 200),
                  1 << 20),
             _row("BlockCache.get_many, 4 keys",
                  await _best_async(lambda i: cache.get_many(keys(small(i), SMALL_BLOCKS)), 3000),
                  16384),
             *await _cache_runs(cache, "inline", MIB_BLOCKS, run_mib, run_small),
             *await _cache_runs(cache, "reader thread", 0, run_mib, run_small),
             *await _bound_loop_runs(cache, run_mib, run_small)]
    cache.inline_max_blocks = INLINE_MAX_BLOCKS
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run_writer)
        fetcher = BlockFetcher(cache, _NoHub(), nursery, hub_timeout=60.0)  # type: ignore[arg-type]
        rows += [_row("BlockFetcher.read, 1 MiB, all hits, writer running",
                      await _best_async(lambda i: fetcher.read(entry, mib(i) * BLOCK_SIZE, 1 << 20),
                                        200), 1 << 20),
                 _row("BlockFetcher.read, 1 MiB from mid-extent, all hits, writer running",
                      await _best_async(lambda i: fetcher.read(entry, mid_extent(i), 1 << 20),
                                        200), 1 << 20),
                 _row("BlockFetcher.read, 16 KiB, all hits, writer running",
                      await _best_async(lambda i: fetcher.read(entry, small(i) * BLOCK_SIZE, 16384),
                                        3000), 16384)]
        nursery.cancel_scope.cancel()
    rows += await _landing_rows(os.path.dirname(cache.store.path))
    rows += [_row("comparison: blocks on their own, read_run of 256",
                  _best(lambda i: loose.read_run(FILE_ID, VERSION, mib(i), MIB_BLOCKS), 300),
                  1 << 20),
             _row("comparison: blocks on their own, read_run of 4",
                  _best(lambda i: loose.read_run(FILE_ID, VERSION, small(i), SMALL_BLOCKS),
                        5000), 16384)]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.read_path_costs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS,
                        help=f"blocks in the store, a multiple of 256 [{DEFAULT_BLOCKS}]")
    parser.add_argument("--workdir", default="/var/tmp",
                        help="where the scratch LMDB files go [/var/tmp]")
    args = parser.parse_args(argv)
    if args.blocks % MIB_BLOCKS or args.blocks < 2 * MIB_BLOCKS:
        parser.error("--blocks must be a multiple of 256, at least 512")
    scratch = tempfile.mkdtemp(prefix="nc-read-path-", dir=args.workdir)
    try:
        data = np.random.default_rng(1).bytes(args.blocks * BLOCK_SIZE)
        store = _fill_store(os.path.join(scratch, "blocks.lmdb"), args.blocks, data, True)
        cache = BlockCache(store, args.blocks * BLOCK_SIZE * 2)
        loose = _fill_store(os.path.join(scratch, "loose.lmdb"), args.blocks, data, False)
        try:
            rows = trio.run(_measure, cache, loose, args.blocks)
        finally:
            loose.close()
            cache.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.blocks} blocks of 4 KiB in LMDB (page cache warm); best of {REPEATS} runs")
    print(f"{'':<58}{'per call':>12}{'that alone':>14}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
