"""The warm read path without FUSE: the fetcher's one-piece cache read, and how reads reach the
prefetch pump (continuations of a stream merged and left for the tick, everything else at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import trio
import trio.testing

from fabric.protocol import MetaEntry
from fuse_mount.block_cache import BlockCache
from fuse_mount.block_store import BlockKey, BlockStore
from fuse_mount.fetcher import BlockFetcher, _Fetch
from fuse_mount.namespace import Namespace
from fuse_mount.prefetch import (REST_AFTER, RESTING_TICK_INTERVAL, TICK_INTERVAL,
                                 PrefetchPump)
from neuralcache.blocks import BLOCK_SIZE
from neuralcache.events import AccessEvent, LinkEstimate
from tests.fabric_helpers import metric

FILE_SIZE = 10 * BLOCK_SIZE + 123
"""Ten full blocks and a short last one."""
DATA = bytes(range(256)) * (FILE_SIZE // 256) + bytes(FILE_SIZE % 256)
ENTRY = MetaEntry("data.bin", "f", 0o444, FILE_SIZE, 0, 7, 3)
ROOT = MetaEntry("", "d", 0o755, 0, 0, 1, 1)


def in_parts(data: bytes) -> list[bytes]:
    """``data`` as the client may hand a prefetch over: in parts, each but the last whole
    blocks (the replies it came in)."""
    return [data[:BLOCK_SIZE], data[BLOCK_SIZE:]] if len(data) > BLOCK_SIZE else [data]


class FakeHub:
    """Serves DATA and counts what it was asked for."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    async def read(self, file_id: int, version: int, first: int, count: int,
                   **kwargs: Any) -> bytes:
        self.reads.append((first, count))
        return DATA[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]

    def start_prefetch(self, file_id: int, version: int, first: int, count: int, *,
                       deadline: float, on_done: Callable[[list[bytes] | BaseException], None]
                       ) -> None:
        """As the real client does: the answer comes later, from another task, in parts."""
        async def answer() -> None:
            try:
                on_done(in_parts(await self.read(file_id, version, first, count)))
            except OSError as exc:
                on_done(exc)
        trio.lowlevel.spawn_system_task(answer)


def open_cache(path: Path) -> BlockCache:
    return BlockCache(BlockStore(str(path), 1 << 20), 1 << 20)


def fill(cache: BlockCache, blocks: Iterable[int]) -> None:
    for b in blocks:
        cache.put(BlockKey(ENTRY.file_id, ENTRY.version, b),
                  DATA[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE])


@pytest.mark.parametrize("offset,length", [(0, FILE_SIZE), (5000, 3 * BLOCK_SIZE + 7),
                                           (9 * BLOCK_SIZE + 100, 1 << 20), (0, 1)])
def test_a_warm_read_comes_from_the_cache_in_one_piece(
        tmp_path: Path, offset: int, length: int) -> None:
    cache = open_cache(tmp_path)
    hub = FakeHub()
    misses: list[None] = []
    cached_before = metric("neuralcache_read_bytes_total", {"source": "cache"})

    async def main() -> bytes:
        fill(cache, range(11))
        await cache.flush()
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, hub, nursery, hub_timeout=5.0)  # type: ignore[arg-type]
            fetcher.on_miss = lambda: misses.append(None)
            data = await fetcher.read(ENTRY, offset, length)
            nursery.cancel_scope.cancel()
        return data

    data = trio.run(main)
    cache.close()
    assert data == DATA[offset:offset + length]
    assert hub.reads == [] and misses == []
    assert metric("neuralcache_read_bytes_total", {"source": "cache"}) == cached_before + len(data)


def test_a_read_missing_one_block_asks_the_hub_for_it_and_says_so(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    hub = FakeHub()
    misses: list[None] = []

    async def main() -> bytes:
        fill(cache, range(0, 11, 2))  # every other block
        await cache.flush()
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, hub, nursery, hub_timeout=5.0)  # type: ignore[arg-type]
            fetcher.on_miss = lambda: misses.append(None)
            data = await fetcher.read(ENTRY, BLOCK_SIZE, 2 * BLOCK_SIZE)
            nursery.cancel_scope.cancel()
        return data

    assert trio.run(main) == DATA[BLOCK_SIZE:3 * BLOCK_SIZE]
    cache.close()
    assert hub.reads == [(1, 1)] and misses == [None]


async def start_pump(cache: BlockCache, nursery: trio.Nursery,
                     observe: Callable[[float, AccessEvent], None]
                     ) -> tuple[PrefetchPump, BlockFetcher]:
    """A running pump over ``cache`` for ENTRY, its prefetcher's ``observe`` replaced by
    ``observe``, and the fetcher it is wired to."""
    fetcher = BlockFetcher(cache, FakeHub(), nursery, hub_timeout=5.0)  # type: ignore[arg-type]
    pump = PrefetchPump(Namespace([ROOT, ENTRY]), cache, fetcher, prefetch=True,
                        link=LinkEstimate(25e6, 0.06))
    assert pump.prefetcher is not None
    pump.prefetcher.observe = observe  # type: ignore[method-assign]
    await nursery.start(pump.run)
    return pump, fetcher


def test_hits_reach_the_prefetcher_on_the_tick_merged_and_misses_at_once(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    seen: list[tuple[float, AccessEvent]] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            pump, fetcher = await start_pump(cache, nursery,
                                             lambda now, event: seen.append((now, event)))
            await trio.sleep(TICK_INTERVAL / 2)  # between two ticks
            started = trio.current_time()

            for i in range(4):  # a read and its continuations wait, merged into one read
                pump.on_read(1, ENTRY, i * BLOCK_SIZE, BLOCK_SIZE)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []
            await trio.sleep(TICK_INTERVAL)
            assert [e for _, e in seen] == [AccessEvent(1, ENTRY.file_id, 0, 4 * BLOCK_SIZE)]
            assert seen[0][0] - started <= TICK_INTERVAL

            pump.on_read(1, ENTRY, 4 * BLOCK_SIZE, BLOCK_SIZE)  # continues, but misses:
            fetcher.on_miss()  # the fetcher wakes the pump before it waits for the hub
            await trio.testing.wait_all_tasks_blocked()
            assert [e for _, e in seen[1:]] == [
                AccessEvent(1, ENTRY.file_id, 4 * BLOCK_SIZE, BLOCK_SIZE)]

            pump.on_read(2, ENTRY, 5 * BLOCK_SIZE, BLOCK_SIZE)  # another handle, a hit:
            pump.on_read(1, ENTRY, 9 * BLOCK_SIZE, BLOCK_SIZE)  # kept apart, on the tick
            await trio.testing.wait_all_tasks_blocked()
            assert len(seen) == 2
            await trio.sleep(TICK_INTERVAL)
            assert [e for _, e in seen[2:]] == [
                AccessEvent(2, ENTRY.file_id, 5 * BLOCK_SIZE, BLOCK_SIZE),
                AccessEvent(1, ENTRY.file_id, 9 * BLOCK_SIZE, BLOCK_SIZE)]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    cache.close()


def test_a_pump_with_nothing_to_do_rests_and_the_next_read_wakes_it(tmp_path: Path) -> None:
    """No message for ``REST_AFTER``: the pump ticks once a ``RESTING_TICK_INTERVAL``, not
    twenty times a second. A read sent to it then reaches the prefetcher at once, not on the
    next resting tick, and the pump ticks often again."""
    cache = open_cache(tmp_path)
    seen: list[float] = []
    ticks: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            pump, _ = await start_pump(cache, nursery, lambda now, event: seen.append(now))
            assert pump.prefetcher is not None
            plan = pump.prefetcher.plan

            def counted(now: float, link: LinkEstimate | None = None) -> list[Any]:
                if link is not None:  # a tick's plan (a drain's has no link)
                    ticks.append(now)
                return plan(now, link)

            pump.prefetcher.plan = counted  # type: ignore[method-assign]
            started = trio.current_time()
            await trio.sleep(REST_AFTER + 5 * RESTING_TICK_INTERVAL)
            busy = [t for t in ticks if t - started <= REST_AFTER]
            resting = ticks[len(busy):]
            assert len(busy) >= REST_AFTER / TICK_INTERVAL - 1
            assert 4 <= len(resting) <= 6
            assert all(b - a == pytest.approx(RESTING_TICK_INTERVAL)
                       for a, b in zip(resting, resting[1:]))

            sent = trio.current_time()
            pump.on_read(1, ENTRY, 0, BLOCK_SIZE)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == [sent]
            ticks.clear()
            await trio.sleep(REST_AFTER / 2)
            assert len(ticks) >= REST_AFTER / 2 / TICK_INTERVAL - 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    cache.close()


def test_reads_go_unwatched_while_there_is_nothing_to_fetch(tmp_path: Path) -> None:
    """Every block of the snapshot cached, no prefetch outstanding and no hints: reads are only
    counted. A block missing again, or hints, and reads are shown to the prefetcher again."""
    cache = open_cache(tmp_path)
    seen: list[AccessEvent] = []
    unwatched = metric("neuralcache_prefetch_reads_unwatched_total")

    async def main() -> None:
        fill(cache, range(10))  # all but the short last block
        async with trio.open_nursery() as nursery:
            pump, _ = await start_pump(cache, nursery, lambda now, event: seen.append(event))
            assert pump.prefetcher is not None
            pump.prefetcher.on_hints = lambda now, record: []  # type: ignore[method-assign]

            async def read(block: int) -> None:
                pump.on_read(1, ENTRY, block * BLOCK_SIZE, BLOCK_SIZE)
                await trio.sleep(TICK_INTERVAL)  # a tick: the pump drains and publishes

            await read(0)  # the last block is not cached
            fill(cache, [10])
            await read(1)
            cache.drop([BlockKey(ENTRY.file_id, ENTRY.version, 3)])
            await read(2)
            fill(cache, [3])
            await read(4)
            pump.on_hints(object())  # type: ignore[arg-type]
            await read(5)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    cache.close()
    assert [event.offset // BLOCK_SIZE for event in seen] == [0, 2, 5]
    assert metric("neuralcache_prefetch_reads_unwatched_total") == unwatched + 2


def test_a_prefetch_around_cached_blocks_reports_once_when_all_its_fetches_are_in(
        tmp_path: Path) -> None:
    """``start_prefetch`` starts one fetch per missing run and calls back once, after the last;
    with nothing missing it calls back at once."""
    cache = open_cache(tmp_path)
    hub = FakeHub()
    done: list[bool] = []

    async def main() -> None:
        fill(cache, [2, 5])
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, hub, nursery, hub_timeout=5.0)  # type: ignore[arg-type]
            fetcher.start_prefetch(ENTRY, 0, 8, done.append)
            assert done == []  # three fetches on their way: 0-1, 3-4 and 6-7
            await trio.testing.wait_all_tasks_blocked()
            assert done == [True]
            fetcher.start_prefetch(ENTRY, 1, 4, done.append)  # all cached now
            assert done == [True, True]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(hub.reads) == [(0, 2), (3, 2), (6, 2)]
    assert all(cache.holds(BlockKey(ENTRY.file_id, ENTRY.version, b)) for b in range(8))
    cache.close()


def test_a_prefetch_that_lands_in_parts_is_cached_whole_and_misaligned_parts_fail_it(
        tmp_path: Path) -> None:
    """The client hands a prefetch over in the parts it came in, not joined; the fetcher cuts
    blocks out of each. Parts that do not fall on block boundaries are a changed file."""
    cache = open_cache(tmp_path)
    done: list[bool] = []

    class SkewedHub(FakeHub):
        def start_prefetch(self, file_id: int, version: int, first: int, count: int, *,
                           deadline: float,
                           on_done: Callable[[list[bytes] | BaseException], None]) -> None:
            data = DATA[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]
            on_done([data[:100], data[100:]])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            skewed = BlockFetcher(cache, SkewedHub(), nursery,  # type: ignore[arg-type]
                                  hub_timeout=5.0)
            skewed.start_prefetch(ENTRY, 3, 2, done.append)
            assert done == [False]
            assert not cache.holds(BlockKey(ENTRY.file_id, ENTRY.version, 3))
            fetcher = BlockFetcher(cache, FakeHub(), nursery,  # type: ignore[arg-type]
                                   hub_timeout=5.0)
            fetcher.start_prefetch(ENTRY, 0, 11, done.append)
            await trio.testing.wait_all_tasks_blocked()
            assert done == [False, True]
            assert await fetcher.read(ENTRY, 0, FILE_SIZE) == DATA
            nursery.cancel_scope.cancel()

    trio.run(main)
    cache.close()


def test_a_prefetch_the_client_answers_within_the_call_still_reports(tmp_path: Path) -> None:
    """The real client answers later, from another task; one that answers at once (or fails at
    once) must not leave the caller waiting for a callback that already went by."""
    cache = open_cache(tmp_path)
    done: list[bool] = []

    class PromptHub(FakeHub):
        def start_prefetch(self, file_id: int, version: int, first: int, count: int, *,
                           deadline: float,
                           on_done: Callable[[list[bytes] | BaseException], None]) -> None:
            self.reads.append((first, count))
            on_done([DATA[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]] if first
                    else OSError("hub gone"))

    async def main() -> None:
        fill(cache, [2])
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, PromptHub(), nursery,  # type: ignore[arg-type]
                                   hub_timeout=5.0)
            fetcher.start_prefetch(ENTRY, 3, 2, done.append)  # answered: in the cache
            fetcher.start_prefetch(ENTRY, 0, 2, done.append)  # fails at once
            assert done == [True, False]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert all(cache.holds(BlockKey(ENTRY.file_id, ENTRY.version, b)) for b in (3, 4))
    assert not cache.holds(BlockKey(ENTRY.file_id, ENTRY.version, 0))
    cache.close()


def test_a_prefetch_whose_fetch_fails_reports_false(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    done: list[bool] = []

    class BrokenHub(FakeHub):
        async def read(self, *args: Any, **kwargs: Any) -> bytes:
            raise OSError("hub gone")

    async def main() -> None:
        fill(cache, [1])
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, BrokenHub(), nursery,  # type: ignore[arg-type]
                                   hub_timeout=5.0)
            fetcher.start_prefetch(ENTRY, 0, 3, done.append)  # fetches 0 and 2; both fail
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert done == [False]
    cache.close()


def test_a_fetch_landing_over_held_blocks_leaves_their_extent_whole(tmp_path: Path) -> None:
    """A fetch lands over blocks 10-23 of which 10-19 are held already (another fetch brought
    them first), 0-15 stored as one extent: only 20-23 are put. Putting 10-15 again unpacked
    the extent, which took blocks 0-9 out of the cache."""
    size = 48 * BLOCK_SIZE
    entry = MetaEntry("big.bin", "f", 0o444, size, 0, 9, 1)
    data = bytes(range(256)) * (size // 256)
    cache = BlockCache(BlockStore(str(tmp_path), 1 << 20), 1 << 20)
    dropped: list[BlockKey] = []
    cache.watch(dropped.append, lambda key: False)

    async def main() -> None:
        cache.put_run(entry.file_id, entry.version, 0,
                      [data[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE] for b in range(20)])
        await cache.flush()
        assert cache.store.extents() == [BlockKey(entry.file_id, entry.version, 0)]
        async with trio.open_nursery() as nursery:
            fetcher = BlockFetcher(cache, FakeHub(), nursery,  # type: ignore[arg-type]
                                   hub_timeout=5.0)
            fetch = _Fetch(10, 14, prefetch=False)
            fetcher._landed(entry, fetch, [data[10 * BLOCK_SIZE:24 * BLOCK_SIZE]])
            assert fetch.done.is_set() and fetch.error is None
            await cache.flush()
            assert await fetcher.read(entry, 0, 24 * BLOCK_SIZE) == data[:24 * BLOCK_SIZE]
            nursery.cancel_scope.cancel()
    trio.run(main)
    assert dropped == []
    assert cache.held_blocks(entry.file_id, entry.version) == 24
    assert cache.store.extents() == [BlockKey(entry.file_id, entry.version, 0)]
    cache.close()
