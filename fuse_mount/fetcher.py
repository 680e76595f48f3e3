"""The read path: block keys, cache hits, and single-flight fetches of the missing range.

All readers waiting for the same missing block share one fetch: the first reader registers a
fetch for the whole missing span and every later reader of any block in it waits on that
fetch. Fetches run in the daemon's nursery, so a reader that goes away never strands others.
Prefetches use the same machinery at prefetch priority, without a task: the hub client calls
back when one lands (``HubClient.start_prefetch``). A reader that reaches a block while
its prefetch is on the way waits for that fetch instead of asking the hub a second time, and
if the request for it has not left the client's prefetch queue yet, has it sent at once as a
demand request (``HubClient.expedite``).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import trio

from fabric.client import HubClient, ReadData
from fabric.protocol import MAX_READ_BLOCKS, MetaEntry
from neuralcache.blocks import BLOCK_SIZE, block_count, blocks_for_read, contiguous_runs

from . import metrics
from .block_cache import BlockCache
from .block_store import BlockKey, RunBytes

log = logging.getLogger(__name__)

_CACHE_BYTES = metrics.READ_BYTES.labels(metrics.SOURCE_CACHE)
_HUB_BYTES = metrics.READ_BYTES.labels(metrics.SOURCE_HUB)
_CACHE_LATENCY = metrics.READ_LATENCY.labels(metrics.SOURCE_CACHE)
_HUB_LATENCY = metrics.READ_LATENCY.labels(metrics.SOURCE_HUB)
_HITS = metrics.CACHE_HITS.labels()
_MISSES = metrics.CACHE_MISSES.labels()


class ShortReadError(Exception):
    """The hub returned fewer bytes than the snapshot's size promises: the file changed."""


class FetchCancelled(Exception):
    """The fetch's task was cancelled (the daemon is stopping) before the hub answered."""


@dataclass
class _Fetch:
    first: int
    count: int
    prefetch: bool
    done: trio.Event = field(default_factory=trio.Event)
    blocks: dict[int, bytes] = field(default_factory=dict)
    error: BaseException | None = None
    on_done: list[Callable[[bool], None]] = field(default_factory=list)
    """Called with success once the fetch is done, after ``done`` is set."""


class _Countdown:
    """Calls ``on_done(ok)`` once ``left`` fetches are done, ``ok`` if none of them failed."""

    def __init__(self, left: int, on_done: Callable[[bool], None]) -> None:
        self.left = left
        self.ok = True
        self.on_done = on_done

    def fetched(self, ok: bool) -> None:
        self.ok = self.ok and ok
        self.left -= 1
        if self.left == 0:
            self.on_done(self.ok)


class BlockFetcher:
    """Serves byte ranges of snapshot files from the cache, fetching what is missing."""

    def __init__(self, cache: BlockCache, client: HubClient, nursery: trio.Nursery, *,
                 hub_timeout: float) -> None:
        self.cache = cache
        self.client = client
        self.hub_timeout = hub_timeout
        self._nursery = nursery
        self._inflight: dict[int, _Fetch] = {}  # by the cache's int keys (``cache.keys``)
        self.on_miss: Callable[[], None] = lambda: None
        """Called when a read needs blocks the cache lacks, before it waits for them."""
        self.in_flight: Callable[[int], bool] = self._inflight.__contains__
        """True while a fetch of the key (an int of ``cache.keys``; demand or prefetch) is on its
        way (a plain function: the prefetcher asks block by block)."""

    def start_prefetch(self, entry: MetaEntry, first: int, count: int,
                       on_done: Callable[[bool], None]) -> None:
        """Start bringing blocks ``[first, first + count)`` into the cache at prefetch
        priority; ``on_done(ok)`` is called once they are in, ``ok`` False if any fetch failed.

        Blocks already cached or on their way are skipped (``on_done(True)`` at once if that
        is all of them). No task waits for the fetches: a hinted shuffle starts one prefetch
        per sample, and a task each was a sizeable part of the event loop's work.
        """
        end = min(first + count, block_count(entry.size))
        base = self.cache.keys.base(entry.file_id, entry.version)
        held, inflight = self.cache.policy.holds, self._inflight
        new = [key - base for key in range(base + first, base + end)
               if not (held(key) or key in inflight)]
        fetches = [f for run in contiguous_runs(new)
                   for f in self._start_fetches(entry, run.first, run.end, prefetch=True)]
        if not fetches:
            on_done(True)
            return
        fetched = _Countdown(len(fetches), on_done).fetched
        for fetch in fetches:
            if fetch.done.is_set():  # a client that answered within the call
                fetched(fetch.error is None)
            else:
                fetch.on_done.append(fetched)

    def holds_whole(self, entry: MetaEntry) -> bool:
        """Whether every block of ``entry`` is cached: reading it needs nothing of the hub."""
        return self.cache.held_blocks(entry.file_id, entry.version) >= block_count(entry.size)

    def fetching(self, entry: MetaEntry, first: int, count: int) -> bool:
        """Whether a fetch of any of blocks ``[first, first + count)`` is on its way."""
        return any(map(self._inflight.__contains__,
                       self.cache.keys.run(entry.file_id, entry.version, first, count)))

    async def prefetch(self, entry: MetaEntry, first: int, count: int) -> bool:
        """``start_prefetch``, waiting for it: True once every block is in, False if any fetch
        failed."""
        done = trio.Event()
        result: list[bool] = []

        def finished(ok: bool) -> None:
            result.append(ok)
            done.set()
        self.start_prefetch(entry, first, count, finished)
        await done.wait()
        return result[0]

    async def read(self, entry: MetaEntry, offset: int, length: int) -> RunBytes:
        """``length`` bytes of ``entry`` at ``offset`` (fewer at end of file)."""
        span = blocks_for_read(offset, length, entry.size)
        if span.count == 0:
            return b""
        started = trio.current_time()
        start = offset - span.first * BLOCK_SIZE
        whole = await self.cache.read_run(entry.file_id, entry.version, span.first, span.count)
        if whole is not None:  # every block from the cache, in one piece
            data = whole if start == 0 and len(whole) <= length else (
                memoryview(whole)[start:start + length])  # a view: no copy of a 1 MiB read
            _HITS.inc(span.count)
            _CACHE_BYTES.inc(len(data))
            _CACHE_LATENCY.observe(trio.current_time() - started)
            return data
        keys = [BlockKey(entry.file_id, entry.version, b) for b in range(span.first, span.end)]
        blocks = await self.cache.get_many(keys)
        from_cache = set(blocks)
        missing = [k for k in keys if k not in blocks]
        _HITS.inc(len(from_cache))
        if missing:
            _MISSES.inc(len(missing))
            self.on_miss()
            blocks.update(await self._fetch(entry, missing))
        data = b"".join(blocks[k] for k in keys)[start:start + length]
        self._account(keys, from_cache, start, len(data), started)
        return data

    @staticmethod
    def _account(keys: list[BlockKey], from_cache: set[BlockKey], start: int, length: int,
                 started: float) -> None:
        cached_bytes = 0
        for i, key in enumerate(keys):
            if key in from_cache:
                lo = max(start, i * BLOCK_SIZE)
                hi = min(start + length, (i + 1) * BLOCK_SIZE)
                cached_bytes += max(0, hi - lo)
        _CACHE_BYTES.inc(cached_bytes)
        _HUB_BYTES.inc(length - cached_bytes)
        latency = _CACHE_LATENCY if len(from_cache) == len(keys) else _HUB_LATENCY
        latency.observe(trio.current_time() - started)

    async def _fetch(self, entry: MetaEntry, missing: list[BlockKey]) -> dict[BlockKey, bytes]:
        base = self.cache.keys.base(entry.file_id, entry.version)
        new = [k for k in missing if base + k.block not in self._inflight]
        if new:
            self._start_fetches(entry, new[0].block, new[-1].block + 1)
        waiting = {k: self._inflight[base + k.block] for k in missing}
        # Blocks the prefetcher asked for may still wait in the client's prefetch queue, behind
        # the window and the pacer: now that a reader needs them they go out as demand.
        for run in contiguous_runs([k.block for k, f in waiting.items() if f.prefetch]):
            self.client.expedite(entry.file_id, entry.version, run.first, run.count)
        for fetch in {id(f): f for f in waiting.values()}.values():  # each distinct fetch once
            await fetch.done.wait()
            if fetch.error is not None:
                raise fetch.error
        return {k: f.blocks[k.block] for k, f in waiting.items()}

    def _start_fetches(self, entry: MetaEntry, first: int, end: int, *,
                       prefetch: bool = False) -> list[_Fetch]:
        """One fetch for the missing span (split only at the protocol's request size limit).

        The one place a fetch's priority reaches the client: a demand fetch is a task that
        waits for ``HubClient.read``; a prefetch is queued and paced by the client, served by
        the hub with what demand leaves, and lands through a callback, with no task of its own.
        """
        fetches = []
        deadline = trio.current_time() + self.hub_timeout
        for chunk in range(first, end, MAX_READ_BLOCKS):
            fetch = _Fetch(chunk, min(MAX_READ_BLOCKS, end - chunk), prefetch)
            keys = self.cache.keys.run(entry.file_id, entry.version, fetch.first, fetch.count)
            deque(map(self._inflight.setdefault, keys, itertools.repeat(fetch)), maxlen=0)
            if prefetch:
                self.client.start_prefetch(entry.file_id, entry.version, fetch.first,
                                           fetch.count, deadline=deadline,
                                           on_done=functools.partial(self._landed, entry, fetch))
            else:
                self._nursery.start_soon(self._run, entry, fetch, deadline)
            fetches.append(fetch)
        return fetches

    async def _run(self, entry: MetaEntry, fetch: _Fetch, deadline: float) -> None:
        result: list[ReadData] | BaseException = FetchCancelled("the fetch was cancelled")
        try:
            result = [await self.client.read(entry.file_id, entry.version, fetch.first,
                                             fetch.count, deadline=deadline)]
        except Exception as exc:  # handed to every waiting reader, which translates it
            result = exc
        finally:
            self._landed(entry, fetch, result)

    def _hold(self, entry: MetaEntry, first: int, keys: range, blocks: list[memoryview]
              ) -> None:
        """Put the landed blocks from ``first`` (the cache's ``keys``) it does not hold yet. A
        fetch may land over held ones: a read's fetch spans the blocks between its first and
        last missing ones, some of them on their way in another fetch that lands first. Put
        again, a block of a stored extent unpacks it, and that takes the extent's other blocks
        out of the cache: a cold run read through lost them, and its warm run fetched them
        again (docs/repro.md, session 57)."""
        held = self.cache.policy.holds
        if not any(map(held, keys)):  # the usual landing: one put
            self.cache.put_run(entry.file_id, entry.version, first, blocks)
            return
        fresh = [key - keys[0] + first for key in keys if not held(key)]
        for run in contiguous_runs(fresh):
            self.cache.put_run(entry.file_id, entry.version, run.first,
                               blocks[run.first - first:run.end - first])

    def _landed(self, entry: MetaEntry, fetch: _Fetch,
                result: list[ReadData] | BaseException) -> None:
        """A fetch's bytes, in parts (or why there are none), are in: hold the blocks, wake
        the waiters."""
        keys = self.cache.keys.run(entry.file_id, entry.version, fetch.first, fetch.count)
        if isinstance(result, BaseException):
            fetch.error = result
        else:
            expected = min(fetch.count * BLOCK_SIZE, entry.size - fetch.first * BLOCK_SIZE)
            sizes = [len(part) for part in result]
            if sum(sizes) != expected or any(size % BLOCK_SIZE for size in sizes[:-1]):
                fetch.error = ShortReadError(
                    f"hub sent {sum(sizes)} bytes of {entry.path!r} (in parts of {sizes}) where "
                    f"the snapshot promises {expected}, in whole blocks")
            else:
                # Views, not copies: a copy per block was most of landing a fetch. They keep
                # the fetch's bytes alive until the last of its blocks is written.
                blocks = [view[i:i + BLOCK_SIZE] for view in map(memoryview, result)
                          for i in range(0, len(view), BLOCK_SIZE)]
                fetch.blocks.update(zip(range(fetch.first, fetch.first + fetch.count), blocks))
                self._hold(entry, fetch.first, keys, blocks)
        inflight = self._inflight
        for key in keys:
            if inflight.get(key) is fetch:
                del inflight[key]
        fetch.done.set()
        for on_done in fetch.on_done:
            on_done(fetch.error is None)
