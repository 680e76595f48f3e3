"""The planner: turns predictors' windows into prefetch requests within the budgets.

Budgets: bytes in flight (what the link can carry in a round trip plus a short queue, so demand
misses never wait behind a long prefetch backlog), cache space (guesses needed soon may take at
most a share of the cache; far-off guesses such as a working-set fill only use free space, so a
guess never pushes out a block about to be read), and a lead time (a window only reaches as far
as the link needs to be ahead). Windows are pulled, not pushed: a predictor exposes its current
window and the planner takes the most urgent ranges from all windows, so a prediction that the
reader has already passed is never fetched - stale guesses drop out by construction.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from neuralcache.blocks import BLOCK_SIZE, block_key
from neuralcache.ensemble import Ledger
from neuralcache.events import CacheView, LinkEstimate, PrefetchRequest
from neuralcache.intervals import IntervalSet
from neuralcache.window_queue import Window, WindowQueue

MAX_REQUEST_BLOCKS = 64
"""Largest single prefetch request (256 KiB): big enough to amortise a round trip's overhead,
small enough that a demand read waiting on it is not held up long."""

QUEUE_ALLOWANCE_S = 0.1
"""Prefetch bytes in flight may exceed the bandwidth-delay product by this much queueing time."""

MIN_INFLIGHT_BYTES = 256 * 1024
"""In-flight floor while the link estimate is still tiny (start-up)."""

MIN_ISSUE_BYTES = 64 * 1024
"""Free in-flight budget below which the planner waits for completions instead of issuing. At a
smaller leftover a range is cut to fit, and a cut request's completion frees as little, so the
cutting feeds itself: in the mount a hinted shuffle's 16 KiB samples decayed into 4-8 KiB
requests, each a hub round trip with its per-request cost (two thirds of 9,500 requests were
one or two blocks). Four 16 KiB samples or one 64 KiB stride chunk fit this; the budget is at
least ``MIN_INFLIGHT_BYTES``, so waiting never stalls the planner."""

NEAR_SHARE_OF_CACHE = 0.5
"""Prefetched-but-unread plus in-flight bytes may use at most this share of the cache."""

UNUSED_TTL_S = 300.0
"""A prefetched block unread this long stops being protected and is counted as wasted."""

MAX_PRESENT_RANGES = 4096
"""Stretches ``take_present`` may hold between two calls (the mount takes them after each plan;
a caller that never does keeps only the first ones)."""

PRESENT_RENOTE_S = 30.0
"""A stretch is reported present again once this long has passed: the kernel may have dropped
its pages from RAM since (a dataset larger than RAM, read again next epoch)."""


@dataclass
class PrefetchStats:
    """Counts in blocks (see the ``*_bytes`` properties); ``per_source`` splits issued/useful."""

    issued_requests: int = 0
    issued_blocks: int = 0
    useful_blocks: int = 0  # read after they arrived
    late_blocks: int = 0  # read while still in flight
    wasted_blocks: int = 0  # evicted or expired unread
    failed_blocks: int = 0
    unused_blocks: int = 0  # arrived, not read yet
    inflight_blocks: int = 0
    per_source: dict[str, list[int]] = field(default_factory=dict)  # name -> [issued, useful]

    @property
    def issued_bytes(self) -> int:
        return self.issued_blocks * BLOCK_SIZE

    @property
    def useful_bytes(self) -> int:
        return self.useful_blocks * BLOCK_SIZE

    @property
    def late_bytes(self) -> int:
        return self.late_blocks * BLOCK_SIZE

    @property
    def wasted_bytes(self) -> int:
        return self.wasted_blocks * BLOCK_SIZE


class Planner:
    """Budgets, in-flight bookkeeping and the issued/useful/late/wasted accounting."""

    def __init__(self, cache: CacheView, ledger: Ledger, issue_ttl: dict[str, float],
                 unhurried: frozenset[str] = frozenset()) -> None:
        self.cache = cache
        self.ledger = ledger
        self.issue_ttl = issue_ttl  # sources scored on what they fetch (not shadow-scored)
        self.unhurried = unhurried  # sources whose windows span the working set (the fill)
        self.link: LinkEstimate | None = None
        self._queue = WindowQueue(ledger)
        self._requests: dict[int, PrefetchRequest] = {}
        self._inflight: dict[int, int] = {}  # block key -> request id
        self._inflight_bytes = 0
        self._known: dict[int, IntervalSet] = {}  # file -> blocks known cached or in flight
        self._noted: dict[int, IntervalSet] = {}  # file -> blocks reported by take_present
        self._renote_at = -math.inf  # when _noted is next forgotten
        self._present: list[tuple[int, int, int]] = []
        self._unused: dict[int, str] = {}  # block key -> source, arrived and not read
        self._unused_order: deque[tuple[float, int]] = deque()
        self._ids = itertools.count(1)
        self._stats = PrefetchStats()

    # budgets -------------------------------------------------------------------------------
    def inflight_budget(self) -> int:
        """Prefetch bytes allowed in flight: one bandwidth-delay product plus a short queue."""
        if self.link is None:
            return MIN_INFLIGHT_BYTES
        return max(MIN_INFLIGHT_BYTES,
                   int(self.link.bandwidth * (self.link.min_rtt + QUEUE_ALLOWANCE_S)))

    def lead_time(self) -> float:
        """How long a request issued now takes to arrive when the in-flight budget is full."""
        if self.link is None or self.link.bandwidth <= 0:
            return 0.0
        return self.link.min_rtt + self.inflight_budget() / self.link.bandwidth

    @property
    def unused_bytes(self) -> int:
        return len(self._unused) * BLOCK_SIZE

    # windows -------------------------------------------------------------------------------
    def offer(self, window: Window) -> None:
        """Make a window's ranges eligible for fetching (idempotent)."""
        self._queue.offer(window)

    def changed(self, window: Window) -> None:
        """A stable window (see ``window_queue``) moved without being offered again."""
        self._queue.changed(window)

    def plan(self, now: float, horizon: float) -> list[PrefetchRequest]:
        """Issue the most urgent ranges across all windows until a budget runs out."""
        self._expire_unused(now)
        if now >= self._renote_at:
            self._noted.clear()
            self._renote_at = now + PRESENT_RENOTE_S
        budget = self.inflight_budget() - self._inflight_bytes
        if budget < MIN_ISSUE_BYTES or not self._queue:
            return []
        capacity = self.cache.capacity_bytes()
        near_room = int(NEAR_SHARE_OF_CACHE * capacity) - self._inflight_bytes - self.unused_bytes
        free = self.cache.free_bytes() - self._inflight_bytes
        queue = self._queue
        queue.start(now, horizon, near_only=free < BLOCK_SIZE)  # free only shrinks below
        out: list[PrefetchRequest] = []
        try:
            while budget >= MIN_ISSUE_BYTES:
                popped = queue.pop()
                if popped is None:
                    break
                window, (need_at, _, _) = popped
                far = need_at > now + horizon
                room = min(budget, near_room, free) if far else min(budget, near_room)
                if room < BLOCK_SIZE:
                    if far:
                        continue  # only far guesses need free space; nearer ones may still fit
                    break
                taken = window.take(min(MAX_REQUEST_BLOCKS, room // BLOCK_SIZE))
                queue.taken(window)
                if taken is None:
                    continue
                file_id, first, stop, source = taken
                extra = min(budget, near_room if not far else min(near_room, free)) // BLOCK_SIZE
                for request in self._issue(now, need_at, file_id, first, stop, source,
                                           extra - (stop - first)):
                    out.append(request)
                    size = request.count * BLOCK_SIZE
                    budget -= size
                    near_room -= size
                    free -= size
                queue.put_back(window)
        finally:
            queue.finish()  # windows taken from are re-peeked next time, even after an error
        return out

    def note_present(self, file_id: int, first: int, stop: int, source: str) -> None:
        """A window reaches blocks ``[first, stop)`` that are cached or in flight: report them
        once (``take_present``), so the mount can have cached ones read into RAM from its disk
        before the reader gets there. Not for ``unhurried`` sources: the fill's window is the
        whole working set."""
        if source in self.unhurried or len(self._present) >= MAX_PRESENT_RANGES:
            return
        noted = self._noted.get(file_id)
        if noted is None:
            noted = self._noted[file_id] = IntervalSet()
        for a, b in noted.uncovered(first, stop):
            self._present.append((file_id, a, b))
        noted.add(first, stop)

    def take_present(self) -> list[tuple[int, int, int]]:
        """(file, first, stop) stretches windows found present since the last call, each
        reported once per ``PRESENT_RENOTE_S``."""
        present, self._present = self._present, []
        return present

    def _known_in(self, file_id: int) -> IntervalSet:
        """The file's known-present set, created on first use (not one per call, as a
        ``setdefault`` default would be)."""
        known = self._known.get(file_id)
        if known is None:
            known = self._known[file_id] = IntervalSet()
        return known

    def known(self, file_id: int, block: int) -> bool:
        """True if the block is cached or in flight (remembered, else asked of the cache)."""
        known = self._known.get(file_id)
        if known is not None and known.covers(block):
            return True
        if self.cache.contains(file_id, block):
            self._known_in(file_id).add(block, block + 1)
            return True
        return False

    def unknown_runs(self, file_id: int, first: int, stop: int) -> list[tuple[int, int]]:
        """Sub-ranges of ``[first, stop)`` neither remembered present nor cached."""
        known = self._known_in(file_id)
        present_until, absent_until = self.cache.present_until, self.cache.absent_until
        out = []
        for a, b in known.uncovered(first, stop):
            block = a
            while block < b:
                start = block
                block = absent_until(file_id, block, b)
                if block > start:
                    out.append((start, block))
                start = block
                block = present_until(file_id, block, b)
                known.add(start, block)  # remembered in one step per cached stretch
        return out

    def _issue(self, now: float, need_at: float, file_id: int, first: int, stop: int,
               source: str, room_blocks: int) -> list[PrefetchRequest]:
        """Requests for the blocks of ``[first, stop)`` not cached or in flight.

        Known-present stretches are skipped with one bisection, and the cache is asked about
        a stretch at a time (``present_until``, ``absent_until``), not block by block. The last
        run is extended over following blocks that other windows of the same predictor guess
        too: ranks of a distributed sampler each predict every eighth sample, and one 256 KiB
        request for their union is cheaper than eight 16 KiB ones.
        """
        out: list[PrefetchRequest] = []
        known = self._known_in(file_id)
        cache = self.cache
        guessed_by = self.ledger.guessed_by
        run_start = None
        block = first
        while True:
            if block < stop:
                skip_to = known.next_uncovered(block)
                if skip_to > block:
                    fresh = False
                    self.note_present(file_id, block, min(skip_to, stop), source)
                else:
                    # Fresh up to the first block cached, or known to be (in flight).
                    skip_to = cache.absent_until(file_id, block, known.next_covered(block, stop))
                    fresh = skip_to > block
                    if not fresh:
                        # Cached blocks are remembered a stretch at a time (one insertion
                        # each): a fill walks whole files that are mostly cached already.
                        skip_to = cache.present_until(file_id, block, stop)
                        known.add(block, skip_to)
                        self.note_present(file_id, block, skip_to, source)
            else:
                fresh = (run_start is not None and block - run_start < MAX_REQUEST_BLOCKS
                         and room_blocks > 0 and guessed_by(block_key(file_id, block), source)
                         and not known.covers(block) and not cache.contains(file_id, block))
                skip_to = block + 1
            if fresh:
                room_blocks -= skip_to - block
                if run_start is None:
                    run_start = block
            elif run_start is not None:
                out.append(self._request(now, need_at, file_id, run_start, block, source))
                run_start = None
            if block >= stop and not fresh:
                return out
            block = skip_to

    def _request(self, now: float, need_at: float, file_id: int, first: int, stop: int,
                 source: str) -> PrefetchRequest:
        rid = next(self._ids)
        request = PrefetchRequest(rid, file_id, first, stop - first, source, now, need_at)
        self._requests[rid] = request
        base = block_key(file_id, 0)
        for block in range(first, stop):
            self._inflight[base | block] = rid
        self._known_in(file_id).add(first, stop)
        self._inflight_bytes += request.count * BLOCK_SIZE
        stats = self._stats
        stats.issued_requests += 1
        stats.issued_blocks += request.count
        stats.per_source.setdefault(source, [0, 0])[0] += request.count
        ttl = self.issue_ttl.get(source)
        if ttl is not None:
            self.ledger.register(now, ttl, source, file_id, first, stop)
        return request

    # outcomes ------------------------------------------------------------------------------
    def on_read(self, file_id: int, first: int, stop: int) -> None:
        """A demand read of these blocks: prefetched ones become useful (or late)."""
        self._known_in(file_id).add(first, stop)
        unused, inflight, stats = self._unused, self._inflight, self._stats
        if not unused and not inflight:
            return
        base = block_key(file_id, 0)
        keys = range(base + first, base + stop)
        sources = list(map(unused.pop, keys, itertools.repeat(None)))  # a 1 MiB read is 256 blocks
        for key, source in zip(keys, sources):
            if source is not None:
                stats.useful_blocks += 1
                stats.per_source[source][1] += 1
            elif inflight.pop(key, None) is not None:
                stats.late_blocks += 1

    def on_complete(self, now: float, request: PrefetchRequest, ok: bool) -> None:
        """A prefetch finished (``ok``) or failed; its unread blocks become protected."""
        if self._requests.pop(request.request_id, None) is None:
            return
        self._inflight_bytes -= request.count * BLOCK_SIZE
        rid = request.request_id
        base = block_key(request.file_id, 0)
        inflight = self._inflight
        for block in range(request.first, request.end):
            key = base | block
            if inflight.get(key) != rid:
                continue  # read while in flight (late) or re-requested
            del inflight[key]
            if ok:
                self._unused[key] = request.source
                self._unused_order.append((now, key))
            else:
                self._stats.failed_blocks += 1
                self._known[request.file_id].remove(block, block + 1)

    def on_evicted(self, file_id: int, first: int, stop: int) -> None:
        """The cache dropped these blocks; prefetched ones never read are wasted."""
        known = self._known.get(file_id)
        if known is not None:
            known.remove(first, stop)
        for block in range(first, stop):
            if self._unused.pop(block_key(file_id, block), None) is not None:
                self._stats.wasted_blocks += 1

    def _expire_unused(self, now: float) -> None:
        order = self._unused_order
        while order and order[0][0] + UNUSED_TTL_S <= now:
            _, key = order.popleft()
            if self._unused.pop(key, None) is not None:
                self._stats.wasted_blocks += 1

    def is_protected(self, file_id: int, block: int) -> bool:
        """True for a prefetched block not read yet, or one being fetched: do not evict it."""
        key = block_key(file_id, block)
        return key in self._unused or key in self._inflight

    def settled(self) -> bool:
        """Nothing issued is on its way or unread: every prefetch so far is accounted for
        (useful, late, failed or wasted), so reads from now on can change no count."""
        return not self._unused and not self._inflight and not self._requests

    def stats(self) -> PrefetchStats:
        """A snapshot of the counters."""
        s = self._stats
        return PrefetchStats(
            s.issued_requests, s.issued_blocks, s.useful_blocks, s.late_blocks, s.wasted_blocks,
            s.failed_blocks, len(self._unused), self._inflight_bytes // BLOCK_SIZE,
            {k: list(v) for k, v in s.per_source.items()})
