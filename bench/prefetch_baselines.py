"""Policies NeuralCache's prefetcher is compared against: none, kernel readahead, an oracle.

They implement the same calls as ``neuralcache.prefetcher.Prefetcher`` so the simulator drives
all of them alike.
"""

from __future__ import annotations

import bisect
import itertools

from neuralcache.blocks import BLOCK_SIZE, block_key, block_span
from neuralcache.catalog import Catalog
from neuralcache.events import AccessEvent, CacheView, LinkEstimate, PrefetchRequest
from neuralcache.hints import HintRecord
from neuralcache.planner import MAX_REQUEST_BLOCKS, NEAR_SHARE_OF_CACHE, QUEUE_ALLOWANCE_S
from neuralcache.trace import Trace

LOOKAHEAD_BUDGETS = 4
"""The oracle coalesces a request with blocks read within this many in-flight budgets of reads
(the same request sizes the planner uses, with perfect knowledge of which blocks to merge)."""

READAHEAD_BLOCKS = 32
"""Linux's default read_ahead_kb: 128 KiB ahead of a sequential reader."""


class NoPrefetch:
    """Demand fetching only."""

    def on_access(self, now: float, event: AccessEvent) -> list[PrefetchRequest]:
        return []

    def on_hints(self, now: float, record: HintRecord) -> list[PrefetchRequest]:
        return []

    def on_prefetch_complete(self, now: float, request: PrefetchRequest, ok: bool = True
                             ) -> list[PrefetchRequest]:
        return []

    def on_evicted(self, file_id: int, first: int, count: int = 1) -> None:
        return None

    def is_protected(self, file_id: int, block: int) -> bool:
        return False

    def plan(self, now: float, link: LinkEstimate | None = None) -> list[PrefetchRequest]:
        return []


class KernelReadahead(NoPrefetch):
    """A fixed 128 KiB window ahead of each sequential (file, handle) reader, as the kernel does.

    A read at the file's start or right after the previous read of the same handle is
    sequential; the window is kept ``READAHEAD_BLOCKS`` past the read's end.
    """

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._state: dict[tuple[int, int], tuple[int, int]] = {}  # -> (prev_end, ra_end)
        self._ids = itertools.count(1)

    def on_access(self, now: float, event: AccessEvent) -> list[PrefetchRequest]:
        first, stop = block_span(event.offset, event.length)
        key = (event.stream, event.file_id)
        prev_end, ra_end = self._state.get(key, (-1, 0))
        out = []
        if first == 0 or first == prev_end:
            start = max(ra_end, stop)
            end = min(stop + READAHEAD_BLOCKS, self.catalog.blocks(event.file_id))
            if end > start:
                out.append(PrefetchRequest(next(self._ids), event.file_id, start, end - start,
                                           "readahead", now, now))
                ra_end = end
        self._state[key] = (stop, max(ra_end, stop))
        return out


class Oracle(NoPrefetch):
    """Knows the trace: fetches the next blocks to be read, in order, as fast as the budgets allow.

    Same in-flight budget and cache share as the planner, same link; an upper bound on what
    ordering knowledge can buy (it does not choose cache victims - the cache is LRU for all).
    """

    def __init__(self, trace: Trace, cache: CacheView) -> None:
        self.cache = cache
        self.link: LinkEstimate | None = None
        reads = trace.reads
        self._runs: list[tuple[int, int, int]] = []
        catalog = trace.catalog()
        for fid, off, length in zip(reads["file_id"].tolist(), reads["offset"].tolist(),
                                    reads["length"].tolist()):
            first, stop = block_span(off, length)
            self._runs.append((fid, first, min(stop, catalog.blocks(fid))))
        self._cum = [0]  # bytes read before trace index i
        for fid, first, stop in self._runs:
            self._cum.append(self._cum[-1] + (stop - first) * BLOCK_SIZE)
        self._uses: dict[int, list[int]] = {}
        for i, (fid, first, stop) in enumerate(self._runs):
            for b in range(first, stop):
                self._uses.setdefault(block_key(fid, b), []).append(i)
        self._pos = 0  # furthest read index seen
        self._scan = 0  # reads before this have been fetched or issued
        self._inflight: dict[int, int] = {}
        self._inflight_bytes = 0
        self._unused: set[int] = set()
        self._ids = itertools.count(1)

    def at(self, index: int) -> None:
        """The simulator tells the oracle which trace read is happening."""
        self._pos = max(self._pos, index)
        self._scan = max(self._scan, self._pos)

    def on_access(self, now: float, event: AccessEvent) -> list[PrefetchRequest]:
        first, stop = block_span(event.offset, event.length)
        for b in range(first, stop):
            key = block_key(event.file_id, b)
            self._unused.discard(key)
            self._inflight.pop(key, None)
        return self._plan(now)

    def on_prefetch_complete(self, now: float, request: PrefetchRequest, ok: bool = True
                             ) -> list[PrefetchRequest]:
        self._inflight_bytes -= request.count * BLOCK_SIZE
        for b in range(request.first, request.end):
            key = block_key(request.file_id, b)
            if self._inflight.pop(key, None) is not None:
                self._unused.add(key)
        return self._plan(now)

    def on_evicted(self, file_id: int, first: int, count: int = 1) -> None:
        for b in range(first, first + count):
            key = block_key(file_id, b)
            self._unused.discard(key)
            uses = self._uses.get(key, [])
            j = bisect.bisect_right(uses, self._pos)
            if j < len(uses):
                self._scan = min(self._scan, uses[j])

    def is_protected(self, file_id: int, block: int) -> bool:
        key = block_key(file_id, block)
        return key in self._unused or key in self._inflight

    def plan(self, now: float, link: LinkEstimate | None = None) -> list[PrefetchRequest]:
        if link is not None:
            self.link = link
        return self._plan(now)

    def _plan(self, now: float) -> list[PrefetchRequest]:
        if self.link is None:
            return []
        full = int(self.link.bandwidth * (self.link.min_rtt + QUEUE_ALLOWANCE_S))
        budget = full - self._inflight_bytes
        room = int(NEAR_SHARE_OF_CACHE * self.cache.capacity_bytes()) - BLOCK_SIZE * (
            len(self._unused) + len(self._inflight))
        out: list[PrefetchRequest] = []
        horizon = bisect.bisect_right(self._cum, self._cum[self._scan] + LOOKAHEAD_BUDGETS * full)
        while self._scan < len(self._runs):
            fid, first, stop = self._runs[self._scan]
            for b in range(first, stop):
                if block_key(fid, b) in self._inflight or self.cache.contains(fid, b):
                    continue
                limit = min(budget, room) // BLOCK_SIZE
                if limit < 1:
                    return out
                run = [b]
                while len(run) < min(limit, MAX_REQUEST_BLOCKS) and self._needed_soon(
                        fid, run[-1] + 1, horizon):
                    run.append(run[-1] + 1)
                out.append(self._issue(now, fid, run))
                budget -= len(run) * BLOCK_SIZE
                room -= len(run) * BLOCK_SIZE
            self._scan += 1
        return out

    def _needed_soon(self, fid: int, block: int, horizon: int) -> bool:
        """Not cached or in flight, and read before trace index ``horizon``."""
        key = block_key(fid, block)
        if key in self._inflight or self.cache.contains(fid, block):
            return False
        uses = self._uses.get(key)
        if not uses:
            return False
        j = bisect.bisect_right(uses, self._pos)
        return j < len(uses) and uses[j] < horizon

    def _issue(self, now: float, fid: int, run: list[int]) -> PrefetchRequest:
        req = PrefetchRequest(next(self._ids), fid, run[0], len(run), "oracle", now, now)
        for b in run:
            self._inflight[block_key(fid, b)] = req.request_id
        self._inflight_bytes += len(run) * BLOCK_SIZE
        return req
