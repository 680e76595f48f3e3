"""Hints: the job's announced read order, followed from its low-water mark and fetched ahead.

Each announcer (``source``) has a queue of epochs; an epoch is its items as block ranges in order.
A read is located in the current epoch (a sorted index of item start blocks, one numpy
searchsorted per item it covers) and marks the items it covers as read. The window starts at the
low-water mark, the first item not read yet, and reaches ``depth`` bytes of unread items past it.
Not the furthest item read: the kernel's readahead turns a 16 KiB sample read into a FUSE read
of the next samples in the file too, which sit anywhere in a shuffled epoch, so the furthest item
read jumps ahead of the job and a window following it skips what the job reads next. When reads
stop matching the current epoch but match the start of the next announced epoch, the sequence
moves on. With hints, a fully shuffled epoch is as predictable as a sequential one.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable

import numpy as np

from neuralcache.blocks import BLOCK_SIZE, KEY_SHIFT, block_span
from neuralcache.hints import HintRecord
from neuralcache.planner import NEAR_SHARE_OF_CACHE, Planner
from neuralcache.predictors.base import Context

HINTED = "hinted"

HINT_DEPTH_FACTOR = 4
"""Hinted windows reach at least this many times a stream's depth (before the job's pace is
measured, this is all of the window)."""

HINT_REACH_S = 60.0
"""Once the pace is known, a hinted window reaches this many seconds of the job's reading, up to
the planner's share of the cache: the order is known, so only the budgets (bytes in flight,
cache share) should hold the planner back. Depth matters beyond what the job itself has
outstanding because the kernel's readahead adds the next samples in the file to a sample's
FUSE read, samples that sit anywhere in the rest of a shuffled epoch: a window of a few
horizons (~30 MB) left 96 of a full-size run's 108 MB of demand misses in such readahead tails
beyond the window, each holding up the read it came with for a round trip
(docs/prefetcher.md). Well inside the planner's ``UNUSED_TTL_S``, so what it fetches stays
protected until read. An exact epoch (``HintRecord.exact``: the mount opens its files without
readahead) has no such tails, so its window reaches only the guessed depth: fetching the rest of
the epoch at the link's full rate competed for the CPU with a warm job reading from the cache
(a warm full-size run took 1.12x hub-local's time instead of 1.03x; docs/prefetcher.md)."""

MATCH_WINDOW_ITEMS = 8192
"""A read this many items past the low-water mark still belongs to the current epoch when it
also matches the start of the next one (workers ahead of the others, readahead)."""

LOW_WATER_STALL_READS = 2048
"""Reads past the low-water mark after which an item never read is taken as skipped and the
mark moves on: a loader waits for a missing sample after reading the few hundred it has
outstanding (workers x prefetch factor x batch), so an item this far behind will not come."""

WINDOW_ROUNDS = 4
"""Rounds of growing a window over items read already (each adds the unread depth missing)."""

RATE_FLOOR_S = 0.25
"""A sequence's own rate counts once measured over this long (the mount's rate until then)."""

HINT_GRACE_S = 60.0
"""An announced read is scored wrong only if it has not happened this long after the time the
sequence's pace predicts. The order is the job's own, so a late read means the job ran slower
than its measured pace (starved by the link at a cold start, say), not that the announcement
was wrong; with the usual few-second ledger expiry a slow cold run expired most guesses, the
ledger switched hints off and the reads fell back to demand fetches (see docs/prefetcher.md)."""


RECENT_READS = 4096
"""Reads remembered for an announcement that arrives after them (several times what a loader
has outstanding: workers x prefetch factor x batch)."""

ANNOUNCE_LAG_S = 10.0
"""How long before its announcement a read may still be an epoch's own. ``HintedSampler``
announces from a thread while the first batches are read (0.1-0.8 s in ``bench.repro``): those
reads must count, or the low-water mark stays at the first sample of each worker's first batch.
It moves past an item never read only every ``LOW_WATER_STALL_READS`` reads, so the mark stayed
at the start of the epoch for a whole ``bench.repro`` run: every due time was taken from there,
and the window's guessed part, which widening keeps exact, fell behind the job
(docs/prefetcher.md)."""


MAX_SKIPPED_ITEMS = 256
"""Items read or cached already that one ``take`` walks past before it gives up until the next
plan. Over a warm cache a window of a whole epoch is all cached: walked in one plan, it held the
event loop ~1 s after the hints arrived (FUSE requests, the hint writer's own close, waited);
spread over plans, the walk interleaves with the reads that drive it."""


class _Epoch:
    """One epoch of one announcer, with the lookup index built lazily after appends."""

    __slots__ = ("epoch", "_files", "_firsts", "_stops", "cum", "keys", "order", "dirty",
                 "read", "_read_view", "low", "stalled", "issued", "issued_offset", "registered",
                 "reach", "exact")

    def __init__(self, epoch: int, exact: bool = False) -> None:
        self.epoch = epoch
        self.exact = exact  # read without kernel readahead: no tails past the items
        self._files: list[int] = []
        self._firsts: list[int] = []
        self._stops: list[int] = []
        self.cum: list[int] = [0]
        self.keys = np.empty(0, dtype=np.int64)
        self.order = np.empty(0, dtype=np.int64)
        self.dirty = False
        self.read = bytearray()  # 1 for items a read has covered
        self._read_view: np.ndarray | None = None  # numpy's view of it, for counting
        self.low = 0  # the low-water mark: the first item not read
        self.stalled = 0  # reads past the mark since it last moved
        self.issued = 0
        self.issued_offset = 0
        self.registered = 0  # items before this one are past the guessed part of the window
        self.reach = 0  # end of the fetched part of the window, as of the last peek

    def __len__(self) -> int:
        return len(self._files)

    def append(self, file_id: int, first: int, stop: int) -> None:
        self._files.append(file_id)
        self._firsts.append(first)
        self._stops.append(stop)
        self.cum.append(self.cum[-1] + stop - first)
        self._read_view = None  # a bytearray with a view on it cannot grow
        self.read.append(0)
        self.dirty = True

    def count_read(self, start: int, end: int) -> int:
        """Items read in ``[start, end)``. Counted by numpy over a view of ``read``: for a
        window of tens of thousands of items ``bytearray.count`` took ~25 us, ~15x longer, and
        a plan asks twice per hinted window."""
        view = self._read_view
        if view is None:
            view = self._read_view = np.frombuffer(self.read, dtype=np.uint8)
        return int(np.count_nonzero(view[start:end]))

    def item(self, i: int) -> tuple[int, int, int]:
        return self._files[i], self._firsts[i], self._stops[i]

    def locate(self, file_id: int, block: int, near: int) -> int:
        """Index of an item containing the block (the first at or after ``near``), or -1."""
        if self.dirty:
            starts = (np.asarray(self._files, dtype=np.int64) << KEY_SHIFT) | np.asarray(
                self._firsts, dtype=np.int64)
            self.order = np.argsort(starts, kind="stable")
            self.keys = starts[self.order]
            self.dirty = False
        key = (file_id << KEY_SHIFT) | block
        j = int(np.searchsorted(self.keys, key, side="right")) - 1
        best = -1
        while j >= 0:
            i = int(self.order[j])
            if self._files[i] != file_id or self._stops[i] <= block:
                break
            if i < near:
                return best if best >= 0 else i
            best = i  # duplicates sort by position: walk left to the first one at/after near
            j -= 1
        return best

    def mark_read(self, first_item: int, file_id: int, first: int, stop: int) -> None:
        """Mark the items blocks ``[first, stop)`` of the file cover (``first_item`` holds
        ``first``) and move the low-water mark past every read item."""
        i, block = first_item, first
        while True:
            self.read[i] = 1
            block = self._stops[i]
            if block >= stop:
                break
            i = self.locate(file_id, block, self.low)
            if i < 0:
                break
        if first_item > self.low:
            self.stalled += 1
        self._advance(self.low + 1 if self.stalled > LOW_WATER_STALL_READS else self.low)

    def _advance(self, low: int) -> None:
        """Move the mark to ``low`` (past an item the job skipped), then past read items."""
        read, n = self.read, len(self.read)
        while low < n and read[low]:
            low += 1
        if low == self.low:
            return
        self.low, self.stalled = low, 0
        if self.issued < low:
            self.issued, self.issued_offset = low, 0

    def done(self) -> bool:
        return self.low >= len(self)


class HintSequence:
    """One announcer's epochs and the window over the current one."""

    __slots__ = ("ctx", "source", "epochs", "bytes_read", "t_first")

    def __init__(self, ctx: Context, source: str) -> None:
        self.ctx = ctx
        self.source = source
        self.epochs: deque[_Epoch] = deque()
        self.bytes_read = 0
        self.t_first: float | None = None

    def rate(self, now: float) -> float:
        """Bytes/s read through this sequence; 0 until measured for RATE_FLOOR_S."""
        if self.t_first is None or now - self.t_first < RATE_FLOOR_S:
            return 0.0
        return self.bytes_read / (now - self.t_first)

    def match(self, now: float, file_id: int, first: int, count: int) -> bool:
        """Mark the items this read covers if it is part of the announced order."""
        while self.epochs:
            cur = self.epochs[0]
            nxt = self.epochs[1] if len(self.epochs) > 1 else None
            if nxt is not None and cur.done():
                self.epochs.popleft()  # this epoch is read through; the next one is announced
                continue
            i = cur.locate(file_id, first, cur.low)
            if 0 <= i <= cur.low + MATCH_WINDOW_ITEMS:
                self._read(now, cur, i, file_id, first, count)
                return True
            if nxt is not None and 0 <= nxt.locate(file_id, first, 0) <= MATCH_WINDOW_ITEMS:
                self.epochs.popleft()  # reads moved on to the start of the next epoch
                continue
            if i >= 0:  # far ahead of the job (readahead): read, so never fetched or waited for
                self._read(now, cur, i, file_id, first, count)
                return True
            return False
        return False

    def replay(self, now: float, reads: Iterable[tuple[float, int, int, int]]) -> None:
        """Count reads made before the latest epoch was announced as its own: those within
        ``ANNOUNCE_LAG_S`` of now that fall among its first items and are not counted yet.
        Called with an epoch's first record, which holds its first items (a record carries up
        to 65,536 of them)."""
        epoch = self.epochs[-1]
        for t, file_id, first, count in reads:
            if now - t > ANNOUNCE_LAG_S:
                continue
            i = epoch.locate(file_id, first, epoch.low)
            if 0 <= i <= epoch.low + MATCH_WINDOW_ITEMS and not epoch.read[i]:
                self._read(t, epoch, i, file_id, first, count)

    def _read(self, now: float, epoch: _Epoch, i: int, file_id: int, first: int,
              count: int) -> None:
        if self.t_first is None or now < self.t_first:
            self.t_first = now
        self.bytes_read += count * BLOCK_SIZE
        epoch.mark_read(i, file_id, first, first + count)

    def guess_depth(self, now: float) -> int:
        """Bytes of unread items past the low-water mark that are registered as guesses: a few
        horizons of the job's reading. Not the whole fetch reach: the planner widens a request
        over the following blocks of the file that the same predictor guesses, which suits a
        window a few horizons deep (one request for samples read soon) but would turn every
        16 KiB sample of a whole-epoch guess into a 256 KiB request of samples read at any time."""
        return HINT_DEPTH_FACTOR * self.ctx.depth_bytes(self.rate(now))

    def fetch_depth(self, now: float, epoch: _Epoch) -> int:
        """Bytes of unread items past the low-water mark that may be fetched (HINT_REACH_S)."""
        rate, guessed = self.rate(now), self.guess_depth(now)
        if rate <= 0 or epoch.exact:
            return guessed
        room = int(NEAR_SHARE_OF_CACHE * self.ctx.cache.capacity_bytes())
        return max(guessed, min(int(rate * HINT_REACH_S), room))

    def _end(self, epoch: _Epoch, depth_bytes: int) -> int:
        """End of a window: about ``depth_bytes`` of unread items past the low-water mark.
        Items read already inside it cost nothing, so the window grows by their share (a few
        rounds of counting them; reads far ahead of the window do not count)."""
        depth = depth_bytes // BLOCK_SIZE
        n, cum = len(epoch), epoch.cum
        start = min(epoch.low, n)
        end = min(bisect.bisect_left(cum, cum[start] + depth) + 1, n)
        for _ in range(WINDOW_ROUNDS):
            if end <= start:
                break
            unread = (end - start) - epoch.count_read(start, end)
            span = cum[end] - cum[start]
            unread_blocks = span * unread // (end - start)
            if unread_blocks >= depth or end == n:
                break
            end = min(bisect.bisect_left(cum, cum[end] + depth - unread_blocks) + 1, n)
        return end

    def register(self, now: float) -> None:
        if not self.epochs:
            return
        epoch = self.epochs[0]
        if epoch.registered >= len(epoch):
            return  # the whole epoch is guessed already: no window end can add to it
        end = self._end(epoch, self.guess_depth(now))
        rate = self.ctx.rate(self.rate(now))
        base = epoch.cum[min(epoch.low, len(epoch))]
        for i in range(max(epoch.registered, epoch.low), end):
            if epoch.read[i]:
                continue
            file_id, first, stop = epoch.item(i)
            ahead = (epoch.cum[i] - base) * BLOCK_SIZE / rate
            self.ctx.register(now, HINTED, file_id, first, stop, ahead + HINT_GRACE_S)
        epoch.registered = max(epoch.registered, end)

    def peek(self, now: float) -> tuple[float, str, float] | None:
        if not self.epochs:
            return None
        epoch = self.epochs[0]
        epoch.reach = self._end(epoch, self.fetch_depth(now, epoch))
        if epoch.issued >= epoch.reach:
            return None
        ahead = (epoch.cum[epoch.issued] - epoch.cum[min(epoch.low, len(epoch))]) * BLOCK_SIZE
        return now + max(ahead, 0) / self.ctx.rate(self.rate(now)), HINTED, 1.0

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        if not self.epochs:
            return None
        epoch = self.epochs[0]
        planner = self.ctx.planner
        skipped = 0
        while epoch.issued < epoch.reach and (
                epoch.read[epoch.issued]
                or (epoch.issued_offset == 0 and self._held(planner, epoch.item(epoch.issued)))):
            epoch.issued, epoch.issued_offset = epoch.issued + 1, 0  # read or held: skip it
            skipped += 1
            if skipped >= MAX_SKIPPED_ITEMS:
                return None  # the rest of the walk waits for the next plan
        if epoch.issued >= min(epoch.reach, len(epoch)):
            return None
        file_id, first, stop = epoch.item(epoch.issued)
        a = first + epoch.issued_offset
        b = min(stop, a + max_blocks)
        if b >= stop:
            if epoch.issued >= epoch.registered:
                b = self._widen(epoch, file_id, a, b, max_blocks)
            epoch.issued, epoch.issued_offset = epoch.issued + 1, 0
        else:
            epoch.issued_offset = b - first
        return file_id, a, b, HINTED

    @staticmethod
    def _held(planner: Planner, item: tuple[int, int, int]) -> bool:
        """Whether the item is cached or in flight already (then noted as present)."""
        if planner.unknown_runs(*item):
            return False
        planner.note_present(*item, HINTED)
        return True

    @staticmethod
    def _widen(epoch: _Epoch, file_id: int, a: int, b: int, max_blocks: int) -> int:
        """Past the guessed part of the window, extend a request over the whole unread items
        that follow it in the file and come later within the reach: a sample per request
        (~850 requests/s in the full-size run) left the hub client's queue full and the wire
        at 60 % of the link. Near items are not widened, so they never wait behind far ones."""
        while True:
            j = epoch.locate(file_id, b, epoch.issued + 1)
            if j <= epoch.issued or j >= epoch.reach or epoch.read[j]:
                return b
            _, first, stop = epoch.item(j)
            if first != b or stop - a > max_blocks:
                return b
            b = stop


class HintedPredictor:
    """Turns hint records into per-announcer sequences and follows reads through them."""

    name = HINTED

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.sequences: dict[str, HintSequence] = {}
        self.unknown_paths = 0
        self._recent: deque[tuple[float, int, int, int]] = deque(maxlen=RECENT_READS)
        """(time, file id, first block, blocks) of the latest reads, for ``replay``."""
        self._moved: dict[HintSequence, None] = {}
        """Sequences reads moved since ``register_moved`` last ran, in the order they moved."""

    def on_hints(self, now: float, record: HintRecord) -> None:
        """Append a record's items to its announcer's epoch (a new epoch number starts one)."""
        seq = self.sequences.get(record.source)
        if seq is None:
            seq = self.sequences[record.source] = HintSequence(self.ctx, record.source)
        starts_epoch = not seq.epochs or seq.epochs[-1].epoch != record.epoch
        if starts_epoch:
            seq.epochs.append(_Epoch(record.epoch, record.exact))
        epoch = seq.epochs[-1]
        catalog = self.ctx.catalog
        ids: dict[str, int | None] = {}
        for path, offset, length in record.items:
            file_id = ids[path] if path in ids else ids.setdefault(path, catalog.file_id(path))
            if file_id is None:
                self.unknown_paths += 1
                continue
            first, stop = block_span(offset, min(length, catalog.size(file_id) - offset))
            if stop > first:
                epoch.append(file_id, first, stop)
        if starts_epoch:  # ~9 ms for a full buffer: once per epoch, not per record
            seq.replay(now, self._recent)
        seq.register(now)
        self.ctx.planner.offer(seq)

    def observe(self, now: float, file_id: int, first: int, count: int) -> bool:
        """Follow the read through every announced order; True if one of them holds it. The
        windows it moved are extended at the next plan (``register_moved``)."""
        self._recent.append((now, file_id, first, count))
        matched = False
        for seq in self.sequences.values():
            if seq.match(now, file_id, first, count):
                self._moved[seq] = None
                matched = True
        return matched

    def register_moved(self, now: float) -> None:
        """Guess and offer the new ends of the windows reads moved, once per plan rather than
        per read: the mount plans once per batch of reads, and finding a window's end (a
        search of the epoch and a count of its read items) per read was a fifth or more of
        what an announced read cost the prefetcher (``bench.prefetch_cpu --batch 8``). A read
        moves the end by about an item and a window holds a few horizons of them, so a guess
        made a batch later is still made long before its read."""
        for seq in self._moved:
            seq.register(now)
            self.ctx.planner.offer(seq)
        self._moved.clear()
