"""The prefetcher in the mount: reads and hints in, prefetch fetches out, all off the read path.

A FUSE read only appends ``(time, handle, entry, offset, length)`` to an inbox and wakes one
task, the pump, which does the rest between FUSE requests (while a miss waits for the hub, or
after a hit has been answered): the prefetcher's per-read work, the
trace (``--record-trace``), hint records from the control file, completions of prefetch
fetches and a planning tick every ``TICK_INTERVAL``. Messages are handed over a batch at a time
(``Prefetcher.observe``/``complete``) with one plan after each batch, not one per message. One
task owns the prefetcher, so its calls never interleave and none of them costs a reader
anything but the append.

A read does not wake the pump; a miss does (``BlockFetcher.on_miss``), so only cache hits
wait, at most one tick, and for them the wait changes how often the prefetcher runs (once per
tick for a batch of reads rather than once per read), not what it learns. A pump that has had
nothing to do for ``REST_AFTER`` rests, ticking seldom; then the first read it is sent wakes
it. A read that continues the previous read of its handle (a sequential stream) is merged into
it while the pump has not taken it. With a trace recorded, reads are queued but never merged.

Once there is nothing left to fetch, reads are not queued at all (``PrefetchPump.idle``): the
cache holds every block of the snapshot, every prefetch is accounted for and no job sent hints.
A read then costs the pump nothing: watching a warm pass of random 16 KiB reads had cost the
daemon a tenth of its CPU per read (docs/throughput.md, session 49).

Prefetches go through the BlockFetcher's single-flight map at prefetch priority, so a reader
that reaches a block whose prefetch is on its way waits for that fetch; the bytes in flight
are the planner's own budget (one bandwidth-delay product plus a short queue), which each
completion frees. Every request is reported back, fetched, failed or skipped. The link
estimate given to the planner on each tick is the hub client's congestion model (bottleneck
bandwidth, minimum RTT) once it has one, the configured ``--link-bandwidth``/``--link-rtt``
until then.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from typing import Any, Callable

import trio

from fabric.congestion import CongestionStats
from fabric.protocol import MetaEntry
from neuralcache.blocks import BLOCK_SIZE
from neuralcache.catalog import Catalog
from neuralcache.events import AccessEvent, CacheView, LinkEstimate, PrefetchRequest
from neuralcache.hints import HintRecord
from neuralcache.planner import PrefetchStats
from neuralcache.prefetcher import Prefetcher
from neuralcache.trace import TraceWriter

from . import metrics
from .block_cache import BlockCache
from .block_store import BlockKey
from .fetcher import BlockFetcher
from .namespace import Namespace

log = logging.getLogger(__name__)

TICK_INTERVAL = 0.05
"""Seconds between planning ticks: drops expired guesses, issues what the budgets now allow
and publishes the prefetch metrics."""
REST_AFTER = 1.0
"""Seconds without a message for the pump, or a request issued by its tick, after which the
pump rests: it ticks every ``RESTING_TICK_INTERVAL`` instead, until a message comes. A node's
mount sits unread between jobs, where twenty ticks a second cost the daemon about 12 ms of CPU
a second for nothing (``python -m bench.daemon_cpu --rounds 0 --idle 20``)."""
RESTING_TICK_INTERVAL = 1.0
"""Seconds between the ticks of a resting pump: guesses and unread prefetches still expire, at
most this late, and the metrics stay this fresh."""
MAX_QUEUED_READS = 10_000
"""Reads waiting for the pump beyond this are not shown to the prefetcher (and counted): it
has fallen behind, and by the time it got to them they would describe the past."""
PUMP_BATCH = 8
"""Messages the pump hands to the prefetcher before it plans once and checkpoints: at 20-75 us
each, a FUSE request that became ready meanwhile waits at most about half a millisecond."""
TRACE_FLUSH_INTERVAL = 1.0
"""Seconds between trace flushes, so a killed daemon leaves at most this much unrecorded."""

_READ, _HINTS, _DONE = range(3)  # inbox message kinds


def measured_link(stats: CongestionStats) -> LinkEstimate | None:
    """The congestion controller's path model as a link estimate, or None before it has one."""
    if stats.btl_bw > 0 and math.isfinite(stats.btl_bw) and math.isfinite(stats.min_rtt):
        return LinkEstimate(stats.btl_bw, stats.min_rtt)
    return None


class MountCacheView(CacheView):
    """What the planner may ask of the cache, answered from memory: the LRU policy's keys and
    the fetcher's in-flight map (never LMDB), each keyed by the cache's int keys for the
    snapshot's version of the file.

    The planner asks about every block of the windows it guesses, hundreds per 1 MiB read it
    predicts past: ``contains`` is a dict lookup and two C-level membership tests, and
    ``present_until``/``absent_until`` walk a stretch with those tests inlined, at about half
    the cost of a ``contains`` call per block over 64 blocks or more.
    """

    def __init__(self, namespace: Namespace, cache: BlockCache, fetcher: BlockFetcher) -> None:
        # Where each file's keys start (``BlockCache.keys``), for the snapshot's version.
        self._bases = {e.file_id: cache.keys.base(e.file_id, e.version)
                       for e in namespace.files()}
        self._policy = cache.policy
        self._held = cache.policy.holds
        self._in_flight = fetcher.in_flight

    def contains(self, file_id: int, block: int) -> bool:
        base = self._bases.get(file_id)
        if base is None:
            return True  # not a file of this snapshot: nothing to fetch
        return self._held(base + block) or self._in_flight(base + block)

    def present_until(self, file_id: int, first: int, stop: int) -> int:
        return self._stretch_end(file_id, first, stop, True)

    def absent_until(self, file_id: int, first: int, stop: int) -> int:
        return self._stretch_end(file_id, first, stop, False)

    def _stretch_end(self, file_id: int, first: int, stop: int, present: bool) -> int:
        """The first block of ``[first, stop)`` whose being held or fetched is not ``present``,
        or ``stop``: ``contains`` over the stretch, its look-ups inlined."""
        base = self._bases.get(file_id)
        if base is None:
            return stop if present else first  # contains() holds for every block
        held, in_flight = self._held, self._in_flight
        for key in range(base + first, base + stop):
            if (held(key) or in_flight(key)) != present:
                return key - base
        return stop

    def free_bytes(self) -> int:
        return self._policy.capacity - self._policy.used

    def capacity_bytes(self) -> int:
        return self._policy.capacity


def catalog_of(namespace: Namespace) -> Catalog:
    """The prefetcher's file table for the snapshot (fed in path order: the catalog then only
    ever appends to its per-directory name order)."""
    return Catalog(sorted(((e.file_id, e.path, e.size) for e in namespace.files()),
                          key=lambda item: item[1]))


class PrefetchPump:
    """Feeds reads and hints to the prefetcher and the trace recorder; runs its prefetches.

    ``link`` is the estimate to plan with until ``measure_link`` returns one. With
    ``prefetch=False`` nothing is predicted or fetched; reads and hints are still recorded when
    a trace writer is given.
    """

    def __init__(self, namespace: Namespace, cache: BlockCache, fetcher: BlockFetcher, *,
                 prefetch: bool, link: LinkEstimate,
                 measure_link: Callable[[], LinkEstimate | None] = lambda: None,
                 trace: TraceWriter | None = None) -> None:
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._trace = trace
        self._default_link = link
        self._measure_link = measure_link
        self.prefetcher: Prefetcher | None = None
        if prefetch:
            self.prefetcher = Prefetcher(catalog_of(namespace),
                                         MountCacheView(namespace, cache, fetcher), link=link)
            cache.watch(self._dropped, self._protected)
        self._snapshot_blocks = namespace.total_blocks
        self._hints_seen = False
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._queued_reads = 0
        self._unwatched_reads = 0  # published on the tick (cheap on the path)
        self._stream_end: tuple[int, int, int] | None = None  # last read's (handle, file, end)
        fetcher.on_miss = self.wake
        self._wake = trio.Event()
        self._resting = False  # ticking every RESTING_TICK_INTERVAL: a queued read wakes it
        self._nursery: trio.Nursery | None = None
        self._started = trio.current_time()
        self._published: dict[Any, int] = {}
        self._queue_seconds = 0.0  # accumulated here, published on the tick (cheap on the path)
        self._predict_seconds = 0.0
        self._issue_seconds = 0.0
        self._next_trace_flush = self._started + TRACE_FLUSH_INTERVAL

    # called from FUSE handlers -------------------------------------------------------------
    def on_read(self, fh: int, entry: MetaEntry, offset: int, length: int) -> None:
        """A read arrived; queue it for the pump (see the module docstring). This is all a
        read pays."""
        if self._trace is None:  # else the trace wants every read
            if self.prefetcher is None:
                return  # --no-prefetch: nobody wants the read
            if self.idle():
                self._unwatched_reads += 1
                return
        started = time.perf_counter()
        continues = self._stream_end == (fh, entry.file_id, offset)
        self._stream_end = (fh, entry.file_id, offset + length)
        inbox = self._inbox
        if continues and self._trace is None and inbox and inbox[-1][0] == _READ:
            _, at, last_fh, last_entry, last_offset, last_length = inbox[-1]
            if last_fh == fh and last_entry is entry and last_offset + last_length == offset:
                inbox[-1] = (_READ, at, fh, entry, last_offset, last_length + length)
                self._queue_seconds += time.perf_counter() - started
                return
        if self._queued_reads >= MAX_QUEUED_READS:
            metrics.PREFETCH_EVENTS_DROPPED.inc()
            return
        inbox.append((_READ, trio.current_time(), fh, entry, offset, length))
        self._queued_reads += 1
        if self._resting:
            self._wake.set()
        self._queue_seconds += time.perf_counter() - started

    def idle(self) -> bool:
        """Whether the prefetcher has nothing to do with reads: the cache holds every block of
        the snapshot (at mount it dropped every block the snapshot does not name, and fetches
        only ever add the snapshot's, so counting them is enough), every prefetch so far is
        accounted for, so no count can change, and no hints came, whose windows page cached
        blocks in ahead of the reader. An eviction or a ``cache drop`` ends it."""
        assert self.prefetcher is not None
        return (not self._hints_seen and len(self._cache.policy) >= self._snapshot_blocks
                and self.prefetcher.settled())

    def wake(self) -> None:
        """Hand the queued reads to the prefetcher now (a read missed: it may be behind)."""
        self._wake.set()

    def on_hints(self, record: HintRecord) -> None:
        """A hint record decoded from the control file."""
        self._hints_seen = True
        self._inbox.append((_HINTS, trio.current_time(), record))
        self._wake.set()

    # the pump --------------------------------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Handle the inbox and tick until cancelled; start it in the daemon's nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            next_tick = busy_at = trio.current_time()
            while True:
                with trio.move_on_at(next_tick):
                    await self._wake.wait()
                woken = self._wake.is_set()
                self._wake = trio.Event()
                handled = await self._drain()
                now = trio.current_time()
                if woken or handled:
                    busy_at = now
                    if self._resting:
                        self._resting = False
                        next_tick = min(next_tick, now + TICK_INTERVAL)
                if now >= next_tick:
                    if self._tick(now):
                        busy_at = now
                    self._resting = now - busy_at >= REST_AFTER
                    next_tick = now + (RESTING_TICK_INTERVAL if self._resting else TICK_INTERVAL)

    async def _drain(self) -> int:
        """Hand the inbox to the prefetcher, planning once per batch of messages rather than
        once per message: the plan's cost does not grow with the events behind it. Returns how
        many messages it handled."""
        inbox = self._inbox
        handled = 0
        while inbox:
            batch = min(len(inbox), PUMP_BATCH)
            handled += batch
            started = time.perf_counter()
            requests: list[PrefetchRequest] = []
            for _ in range(batch):
                requests += self._handle(inbox.popleft())
            if self.prefetcher is not None:
                requests += self.prefetcher.plan(trio.current_time())
            self._predict_seconds += time.perf_counter() - started
            self._issue(requests)
            if inbox:
                await trio.sleep(0)
        return handled

    def _handle(self, msg: tuple[Any, ...]) -> list[PrefetchRequest]:
        """One message to the prefetcher (and the trace); what it asks to fetch now."""
        kind = msg[0]
        pf = self.prefetcher
        if kind == _READ:
            _, at, fh, entry, offset, length = msg
            self._queued_reads -= 1
            if self._trace is not None:
                if not self._trace.encoder.knows(entry.file_id):
                    self._trace.file(entry.file_id, entry.path, entry.size)
                self._trace.read(at - self._started, fh, fh, entry.file_id, offset, length)
            if pf is not None:
                pf.observe(trio.current_time(), AccessEvent(fh, entry.file_id, offset, length))
        elif kind == _HINTS:
            _, at, record = msg
            if self._trace is not None:
                self._trace.hint(at - self._started, record)
            if pf is not None:
                return pf.on_hints(trio.current_time(), record)
        elif pf is not None:  # _DONE
            _, request, ok = msg
            pf.complete(trio.current_time(), request, ok)
        return []

    def _tick(self, now: float) -> bool:
        """Plan with the link's latest estimate and publish; whether the plan issued anything."""
        issued = False
        if self.prefetcher is not None:
            started = time.perf_counter()
            link = self._measure_link() or self._default_link
            requests = self.prefetcher.plan(now, link)
            self._predict_seconds += time.perf_counter() - started
            issued = bool(requests)
            self._issue(requests)
        self.publish()
        if self._trace is not None and now >= self._next_trace_flush:
            self._trace.flush()
            self._next_trace_flush = now + TRACE_FLUSH_INTERVAL
        return issued

    # prefetch fetches ------------------------------------------------------------------------
    def _issue(self, requests: list[PrefetchRequest]) -> None:
        assert self._nursery is not None
        started = time.perf_counter()
        for request in requests:
            entry = self._namespace.file(request.file_id)
            if entry is None:
                self._fetched(request, False)
            else:
                self._fetcher.start_prefetch(entry, request.first, request.count,
                                             functools.partial(self._fetched, request))
        if self.prefetcher is not None:
            present = self.prefetcher.take_present()
            if present:
                self._page_in(present)
        self._issue_seconds += time.perf_counter() - started

    def _page_in(self, present: list[tuple[int, int, int]]) -> None:
        """Cached blocks a window reaches: their pages come from the disk now, not when the
        reader gets there (``BlockCache.page_in``), in a task of their own only if one of
        them is not in RAM."""
        runs = []
        for file_id, first, stop in present:
            entry = self._namespace.file(file_id)
            if entry is not None:
                runs.append((file_id, entry.version, first, stop))
        wanted = self._cache.pages_to_read(runs)
        if wanted is not None:
            assert self._nursery is not None
            self._nursery.start_soon(self._cache.page_in, wanted)

    def _fetched(self, request: PrefetchRequest, ok: bool) -> None:
        """A prefetch is done (called by the fetcher): report it to the prefetcher."""
        self._inbox.append((_DONE, request, ok))
        self._wake.set()

    # cache hooks (called synchronously by BlockCache) ------------------------------------
    def _dropped(self, key: BlockKey) -> None:
        assert self.prefetcher is not None
        self.prefetcher.on_evicted(key.file_id, key.block, 1)

    def _protected(self, key: BlockKey) -> bool:
        assert self.prefetcher is not None
        return self.prefetcher.is_protected(key.file_id, key.block)

    # metrics and shutdown --------------------------------------------------------------------
    def publish(self) -> None:
        """Bring the Prometheus counters up to the prefetcher's own accounting."""
        if self.prefetcher is not None:
            stats: PrefetchStats = self.prefetcher.stats()
            for counter, value in ((metrics.PREFETCH_ISSUED_BYTES, stats.issued_bytes),
                                   (metrics.PREFETCH_USEFUL_BYTES, stats.useful_bytes),
                                   (metrics.PREFETCH_LATE_BYTES, stats.late_bytes),
                                   (metrics.PREFETCH_WASTED_BYTES, stats.wasted_bytes),
                                   (metrics.PREFETCH_FAILED_BYTES,
                                    stats.failed_blocks * BLOCK_SIZE)):
                self._advance(counter, value)
            for predictor, (issued, useful) in stats.per_source.items():
                self._advance(metrics.PREFETCH_PREDICTOR_ISSUED_BYTES.labels(predictor),
                              issued * BLOCK_SIZE)
                self._advance(metrics.PREFETCH_PREDICTOR_USEFUL_BYTES.labels(predictor),
                              useful * BLOCK_SIZE)
            metrics.PREFETCH_INFLIGHT_BYTES.set(stats.inflight_blocks * BLOCK_SIZE)
        metrics.PREFETCH_READS_UNWATCHED.inc(self._unwatched_reads)
        self._unwatched_reads = 0
        metrics.PREFETCH_CPU_SECONDS.labels("queue").inc(self._queue_seconds)
        metrics.PREFETCH_CPU_SECONDS.labels("predict").inc(self._predict_seconds)
        metrics.PREFETCH_CPU_SECONDS.labels("issue").inc(self._issue_seconds)
        self._queue_seconds = self._predict_seconds = self._issue_seconds = 0.0

    def _advance(self, counter: Any, value: int) -> None:
        counter.inc(value - self._published.get(counter, 0))
        self._published[counter] = value

    def close(self) -> None:
        """At unmount: publish the last counts and write out the rest of the trace."""
        self.publish()
        if self._trace is not None:
            self._trace.flush()
