"""Trace-driven simulation of a spoke: block cache, link to the hub, and a prefetch policy.

Link model (one bottleneck, the hub's egress): a request reaches the hub after RTT/2, its bytes
are serialised at ``bandwidth`` and arrive RTT/2 after the last one. Demand fetches have strict
priority (the hub sends them first); prefetches use the gaps, in the order issued. A read that
needs a block still queued as a prefetch promotes that prefetch to demand priority.

Replay is elastic per actor (closed loop): each actor (data-loader worker) waits for its read to
complete before its next one, and keeps the trace's think time between them, so misses slow the
reader down as they would in a real run instead of piling up. ``elastic=False`` replays the
timestamps as recorded (open loop). The cache is LRU over 4 KiB blocks and never evicts a block
the policy protects (prefetched, not yet read) while it has another choice.

``MountModel`` adds what a real mount does beyond that ideal, to tell which of its limits costs
what: a cap on prefetch requests fetching at once (the rest wait, unseen by the reads' fetch
path, as in the mount's pump), reads that wait for a queued prefetch instead of promoting it,
and small demand fetches sent twice (the hub client's hedged reads). ``Result.link_bytes``
counts every byte the link carried, so bytes moved per byte read can be compared.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from neuralcache.blocks import BLOCK_SIZE, KEY_SHIFT, block_key, block_span
from neuralcache.catalog import Catalog
from neuralcache.events import AccessEvent, CacheView, LinkEstimate, PrefetchRequest
from neuralcache.hints import HintRecord
from neuralcache.trace import Trace

TICK_S = 0.05
"""The policy's periodic ``plan`` call, as the mount's timer would make it."""

BINS = 150
"""Hit ratio over time is reported in this many bins of the trace's reads (its progress), so
policies that run at different speeds line up epoch by epoch."""

EVICTION_PROBES = 64
"""Protected blocks skipped per eviction before the oldest one is evicted anyway."""


class Policy(Protocol):
    def on_access(self, now: float, event: AccessEvent) -> list[PrefetchRequest]: ...
    def on_hints(self, now: float, record: HintRecord) -> list[PrefetchRequest]: ...
    def on_evicted(self, file_id: int, first: int, count: int = 1) -> None: ...
    def is_protected(self, file_id: int, block: int) -> bool: ...
    def plan(self, now: float, link: LinkEstimate | None = None) -> list[PrefetchRequest]: ...
    def on_prefetch_complete(self, now: float, request: PrefetchRequest,
                             ok: bool = True) -> list[PrefetchRequest]: ...


@dataclass(frozen=True)
class MountModel:
    """The mount's own limits on top of the ideal link (the defaults are the ideal)."""

    max_prefetch_requests: int | None = None  # prefetch requests fetching at once; more wait
    promote: bool = True  # a read of a queued prefetch sends its rest at demand priority
    hedge_blocks: int = 0  # demand fetches of up to this many blocks cross the link twice


@dataclass(frozen=True)
class LinkModel:
    rtt: float = 0.060
    bandwidth: float = 200e6 / 8  # bytes/s

    def estimate(self) -> LinkEstimate:
        return LinkEstimate(self.bandwidth, self.rtt)


class SimCache(CacheView):
    """LRU block cache (CacheView for the policy); eviction skips protected blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity // BLOCK_SIZE, 1)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pending: dict[int, "Transfer"] = {}
        self.protect: Callable[[int, int], bool] = lambda f, b: False

    def contains(self, file_id: int, block: int) -> bool:
        key = block_key(file_id, block)
        return key in self.lru or key in self.pending

    def free_bytes(self) -> int:
        return (self.capacity - len(self.lru) - len(self.pending)) * BLOCK_SIZE

    def capacity_bytes(self) -> int:
        return self.capacity * BLOCK_SIZE

    def insert(self, key: int) -> list[int]:
        """Hold ``key``; return evicted keys."""
        lru = self.lru
        lru[key] = None
        evicted = []
        while len(lru) > self.capacity:
            victim = None
            for _ in range(EVICTION_PROBES):
                k = next(iter(lru))
                if not self.protect(k >> KEY_SHIFT, k & ((1 << KEY_SHIFT) - 1)):
                    victim = k
                    break
                lru.move_to_end(k)
            if victim is None:
                victim = next(iter(lru))
            del lru[victim]
            evicted.append(victim)
        return evicted


class Transfer:
    __slots__ = ("keys", "remaining", "ready_at", "arrival", "request", "cancelled")

    def __init__(self, keys: list[int], ready_at: float, request: PrefetchRequest | None):
        self.keys = keys
        self.remaining = len(keys) * BLOCK_SIZE
        self.ready_at = ready_at
        self.arrival: float | None = None
        self.request = request  # None for demand fetches
        self.cancelled = False


class Link:
    """Demand lane with strict priority; the prefetch lane fills the gaps (see module doc)."""

    def __init__(self, model: LinkModel, hedge_blocks: int = 0) -> None:
        self.rtt = model.rtt
        self.bw = model.bandwidth
        self.hedge_blocks = hedge_blocks
        self.demand_end = 0.0
        self.busy: deque[tuple[float, float]] = deque()  # demand serialisation intervals
        self.queue: deque[Transfer] = deque()  # prefetches waiting or partly sent
        self.cursor = 0.0  # prefetch lane: serialised up to here
        self.arrivals: list[tuple[float, int, Transfer]] = []
        self._seq = 0
        self.bytes_sent = 0

    def demand(self, now: float, transfer: Transfer) -> float:
        start = max(self.demand_end, now + self.rtt / 2)
        done = start + transfer.remaining / self.bw
        copies = 2 if 0 < len(transfer.keys) <= self.hedge_blocks else 1
        end = start + copies * transfer.remaining / self.bw  # a hedge's twin follows it
        self.demand_end = end
        if self.busy and self.busy[-1][1] >= start:
            self.busy[-1] = (self.busy[-1][0], end)
        else:
            self.busy.append((start, end))
        self.bytes_sent += copies * transfer.remaining
        transfer.remaining = 0
        self._arrive(transfer, done + self.rtt / 2)
        return transfer.arrival  # type: ignore[return-value]

    def expected_arrival(self, transfer: Transfer) -> float:
        """When a queued prefetch arrives if nothing more is sent before it (demand to come
        would only delay it): what a reader waiting for it, unpromoted, waits until."""
        if transfer.arrival is not None:
            return transfer.arrival
        c = max(self.cursor, self.demand_end)
        for tr in self.queue:
            if tr.cancelled:
                continue
            c = max(c, tr.ready_at) + tr.remaining / self.bw
            if tr is transfer:
                break
        return c + self.rtt / 2

    def prefetch(self, now: float, transfer: Transfer) -> None:
        transfer.ready_at = now + self.rtt / 2
        self.queue.append(transfer)

    def promote(self, now: float, transfer: Transfer) -> tuple[float, Transfer]:
        """A demand read needs a queued prefetch: send the rest of it with demand priority."""
        transfer.cancelled = True
        rest = Transfer(transfer.keys, 0.0, transfer.request)
        rest.remaining = transfer.remaining
        return self.demand(now, rest), rest

    def _arrive(self, transfer: Transfer, at: float) -> None:
        transfer.arrival = at
        self._seq += 1
        heapq.heappush(self.arrivals, (at, self._seq, transfer))

    def serialize_until(self, x: float) -> None:
        c = self.cursor
        queue, busy = self.queue, self.busy
        while queue:
            tr = queue[0]
            if tr.cancelled:
                queue.popleft()
                continue
            c = max(c, tr.ready_at)
            while busy and busy[0][1] <= c:
                busy.popleft()
            if busy and busy[0][0] <= c:
                c = busy[0][1]
                continue
            if c >= x:
                break
            gap_end = min(x, busy[0][0] if busy else math.inf)
            can = (gap_end - c) * self.bw
            if can >= tr.remaining:
                c += tr.remaining / self.bw
                self.bytes_sent += tr.remaining
                tr.remaining = 0
                queue.popleft()
                self._arrive(tr, c + self.rtt / 2)
            else:
                tr.remaining -= can
                self.bytes_sent += can
                c = gap_end
        self.cursor = c


@dataclass
class Result:
    """What one (trace, policy) run measured; counts are blocks."""

    demand_blocks: int = 0
    hit_blocks: int = 0
    demand_fetched: int = 0
    prefetched: int = 0
    link_bytes: int = 0  # every byte the link carried (hedged demand twice)
    read_bytes: int = 0  # bytes the trace's reads asked for
    useful_on_time: int = 0
    useful_late: int = 0
    wasted: int = 0
    makespan: float = 0.0
    trace_span: float = 0.0
    bins_hits: list[int] = field(default_factory=list)
    bins_total: list[int] = field(default_factory=list)
    epoch_hits: list[int] = field(default_factory=list)
    epoch_total: list[int] = field(default_factory=list)
    on_access_s: float = 0.0  # wall time spent in the policy's on_access
    accesses: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / max(self.demand_blocks, 1)

    @property
    def accuracy(self) -> float:
        useful = self.useful_on_time + self.useful_late
        return useful / self.prefetched if self.prefetched else 0.0

    @property
    def coverage(self) -> float:
        useful = self.useful_on_time + self.useful_late
        return useful / max(useful + self.demand_fetched, 1)

    @property
    def timeliness(self) -> float:
        useful = self.useful_on_time + self.useful_late
        return self.useful_on_time / useful if useful else 0.0

    @property
    def wasted_share(self) -> float:
        return self.wasted / max(self.prefetched + self.demand_fetched, 1)

    @property
    def link_per_read(self) -> float:
        """Bytes moved over the link per byte read: 1.0 when each block crosses once."""
        return self.link_bytes / max(self.read_bytes, 1)

    def epoch_ratio(self, e: int) -> float:
        return self.epoch_hits[e] / max(self.epoch_total[e], 1)


class Simulation:
    """Replays one trace against one policy; see the module docstring."""

    def __init__(self, trace: Trace, make_policy: Callable[[Catalog, SimCache], Policy],
                 link: LinkModel, cache_bytes: int, elastic: bool = True,
                 mount: MountModel = MountModel()) -> None:
        self.trace = trace
        self.link_model = link
        self.mount = mount
        self.link = Link(link, mount.hedge_blocks)
        self._fetching = 0  # prefetch transfers on their way (the mount's capped count)
        self._parked: deque[PrefetchRequest] = deque()  # waiting for a fetch slot
        self.cache = SimCache(cache_bytes)
        self.catalog = trace.catalog()
        self.policy = make_policy(self.catalog, self.cache)
        self.cache.protect = self.policy.is_protected
        self.elastic = elastic
        self.result = Result()
        self._unused: set[int] = set()  # prefetched, arrived, not read yet
        self._late: set[int] = set()  # read while their prefetch was in flight
        self._next_tick = 0.0

    # link + cache plumbing -----------------------------------------------------------------
    def _submit(self, now: float, requests: list[PrefetchRequest]) -> None:
        cache = self.cache
        cap = self.mount.max_prefetch_requests
        work = self._parked  # FIFO, as the pump's limiter: earlier requests first
        work.extend(requests)
        while work:
            if cap is not None and self._fetching >= cap:
                return  # the rest wait for a slot, not yet in flight for the reads
            req = work.popleft()
            keys = []
            for block in range(req.first, req.end):
                key = block_key(req.file_id, block)
                if key not in cache.lru and key not in cache.pending:
                    keys.append(key)
            if not keys:
                work.extend(self.policy.on_prefetch_complete(now, req, True))
                continue
            tr = Transfer(keys, 0.0, req)
            for key in keys:
                cache.pending[key] = tr
            self.result.prefetched += len(keys)
            self._fetching += 1
            self.link.prefetch(now, tr)

    def _deliver(self, at: float, tr: Transfer) -> None:
        cache, result = self.cache, self.result
        for key in tr.keys:
            if cache.pending.get(key) is tr:
                del cache.pending[key]
                if tr.request is not None and key not in self._late:
                    self._unused.add(key)
                self._late.discard(key)
                for victim in cache.insert(key):
                    if victim in self._unused:
                        self._unused.discard(victim)
                        result.wasted += 1
                    self.policy.on_evicted(victim >> KEY_SHIFT, victim & ((1 << KEY_SHIFT) - 1))
        if tr.request is not None:
            self._fetching -= 1
            self._submit(at, self.policy.on_prefetch_complete(at, tr.request, True))

    def _advance(self, now: float) -> None:
        link = self.link
        while True:
            a = link.arrivals[0][0] if link.arrivals else math.inf
            x = min(a, self._next_tick, now)
            link.serialize_until(x)
            if link.arrivals and link.arrivals[0][0] <= x:
                at, _, tr = heapq.heappop(link.arrivals)
                self._deliver(at, tr)
            elif self._next_tick <= x:
                t = self._next_tick
                self._next_tick += TICK_S
                self._submit(t, self.policy.plan(t, self.link_model.estimate()))
            else:
                return

    def _serve(self, now: float, fid: int, first: int, stop: int) -> tuple[float, int]:
        """A read of blocks ``[first, stop)`` at ``now``: when its last block is there, and how
        many were hits. Blocks in flight are waited for (promoted to demand if the mount
        does that), missing ones fetched as one demand transfer."""
        cache, result, link = self.cache, self.result, self.link
        done = now
        hits = 0
        missing: list[int] = []
        for block in range(first, stop):
            key = block_key(fid, block)
            if key in cache.lru:
                hits += 1
                cache.lru.move_to_end(key)
                if key in self._unused:
                    self._unused.discard(key)
                    result.useful_on_time += 1
                continue
            tr = cache.pending.get(key)
            if tr is None:
                missing.append(key)
                continue
            if tr.request is not None and key not in self._late:
                self._late.add(key)
                result.useful_late += 1
            if tr.arrival is None and not self.mount.promote:
                done = max(done, link.expected_arrival(tr))
                continue
            if tr.arrival is None:
                arrival, rest = link.promote(now, tr)
                for k in tr.keys:
                    if cache.pending.get(k) is tr:
                        cache.pending[k] = rest
                tr = rest
            done = max(done, tr.arrival)  # type: ignore[type-var]
        if missing:
            tr = Transfer(missing, 0.0, None)
            for key in missing:
                cache.pending[key] = tr
            result.demand_fetched += len(missing)
            done = max(done, link.demand(now, tr))
        return done, hits

    # the replay ----------------------------------------------------------------------------
    def run(self) -> Result:
        reads = self.trace.reads
        result = self.result
        n = len(reads)
        if n == 0:
            return result
        t_orig = reads["t"].tolist()
        actors = reads["actor"].tolist()
        streams = reads["stream"].tolist()
        files = reads["file_id"].tolist()
        offsets = reads["offset"].tolist()
        lengths = reads["length"].tolist()
        epoch_starts = list(self.trace.meta.get("epoch_starts", [0]))  # type: ignore[arg-type]
        epoch_of = np.searchsorted(np.asarray(epoch_starts), np.arange(n), side="right") - 1
        result.epoch_hits = [0] * len(epoch_starts)
        result.epoch_total = [0] * len(epoch_starts)
        following: dict[int, int] = {}
        first_of: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            a = actors[i]
            if a in first_of:
                following[i] = first_of[a]
            first_of[a] = i
        heap = [(t_orig[i], i) for i in first_of.values()]
        heapq.heapify(heap)
        shift: dict[int, float] = {a: 0.0 for a in first_of}
        hints = self.trace.hints
        hp = 0
        policy, cache, link = self.policy, self.cache, self.link
        self._next_tick = t_orig[0]
        at_index = getattr(policy, "at", None)
        bins_h: dict[int, int] = {}
        bins_t: dict[int, int] = {}
        t0 = t_orig[0]
        makespan = t0
        while heap:
            now, i = heapq.heappop(heap)
            while hp < len(hints) and hints[hp][0] <= t_orig[i]:
                self._advance(now)
                self._submit(now, policy.on_hints(now, hints[hp][1]))
                hp += 1
            self._advance(now)
            fid = files[i]
            first, stop = block_span(offsets[i], lengths[i])
            stop = min(stop, self.catalog.blocks(fid))
            done, hits = self._serve(now, fid, first, stop)
            total = stop - first
            result.demand_blocks += total
            result.read_bytes += lengths[i]
            result.hit_blocks += hits
            e = epoch_of[i]
            result.epoch_hits[e] += hits
            result.epoch_total[e] += total
            b = i * BINS // n
            bins_h[b] = bins_h.get(b, 0) + hits
            bins_t[b] = bins_t.get(b, 0) + total
            if at_index is not None:
                at_index(i)
            w0 = time.perf_counter()
            reqs = policy.on_access(now, AccessEvent(streams[i], fid, offsets[i], lengths[i]))
            result.on_access_s += time.perf_counter() - w0
            result.accesses += 1
            self._submit(now, reqs)
            a = actors[i]
            if self.elastic:
                shift[a] += done - now
            makespan = max(makespan, done)
            j = following.get(i)
            if j is not None:
                heapq.heappush(heap, (max(t_orig[j] + shift[a], done), j))
        self._advance(makespan + 10 * self.link_model.rtt)
        result.wasted += len(self._unused) + sum(
            1 for k, tr in cache.pending.items() if tr.request is not None and k not in self._late)
        result.link_bytes = int(link.bytes_sent)
        result.makespan = makespan - t0
        result.trace_span = t_orig[-1] - t0
        nb = max(bins_t) + 1 if bins_t else 0
        result.bins_hits = [bins_h.get(k, 0) for k in range(nb)]
        result.bins_total = [bins_t.get(k, 0) for k in range(nb)]
        return result
