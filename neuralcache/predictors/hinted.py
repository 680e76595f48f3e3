"""Hints: the job's announced read order, followed by a cursor and fetched ahead of it.

Each announcer (``source``) has a queue of epochs; an epoch is its items as block ranges in order.
A read is located in the current epoch (a sorted index of item start blocks, one numpy
searchsorted per read); the cursor is the furthest item read, and the window covers the items
after it. When reads stop matching the current epoch near its cursor but match the start of the
next announced epoch, the sequence moves on. With hints, a fully shuffled epoch is as predictable
as a sequential one.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from neuralcache.blocks import BLOCK_SIZE, KEY_SHIFT, block_span
from neuralcache.hints import HintRecord
from neuralcache.predictors.base import Context

HINTED = "hinted"

HINT_DEPTH_FACTOR = 4
"""Hinted windows reach this many times a stream's depth: the order is known, only the budgets
(bytes in flight, cache share) should hold the planner back."""

MATCH_WINDOW_ITEMS = 8192
"""A read may land this many items past the cursor (workers ahead of the others) and still count."""

RATE_FLOOR_S = 0.25
"""A sequence's own rate counts once measured over this long (the mount's rate until then)."""


class _Epoch:
    """One epoch of one announcer, with the lookup index built lazily after appends."""

    __slots__ = ("epoch", "_files", "_firsts", "_stops", "cum", "keys", "order", "dirty",
                 "cursor", "issued", "issued_offset", "registered")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._files: list[int] = []
        self._firsts: list[int] = []
        self._stops: list[int] = []
        self.cum: list[int] = [0]
        self.keys = np.empty(0, dtype=np.int64)
        self.order = np.empty(0, dtype=np.int64)
        self.dirty = False
        self.cursor = -1
        self.issued = 0
        self.issued_offset = 0
        self.registered = 0

    def __len__(self) -> int:
        return len(self._files)

    def append(self, file_id: int, first: int, stop: int) -> None:
        self._files.append(file_id)
        self._firsts.append(first)
        self._stops.append(stop)
        self.cum.append(self.cum[-1] + stop - first)
        self.dirty = True

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
        """Advance the cursor if this read is part of the announced order."""
        while self.epochs:
            cur = self.epochs[0]
            nxt = self.epochs[1] if len(self.epochs) > 1 else None
            if nxt is not None and cur.cursor >= len(cur) - 1:
                self.epochs.popleft()  # this epoch is read through; the next one is announced
                continue
            i = cur.locate(file_id, first, cur.cursor)
            if 0 <= i <= cur.cursor + MATCH_WINDOW_ITEMS:
                self._read(now, cur, i, count)
                return True
            if nxt is not None and 0 <= nxt.locate(file_id, first, 0) <= MATCH_WINDOW_ITEMS:
                self.epochs.popleft()  # reads moved on to the start of the next epoch
                continue
            return False
        return False

    def _read(self, now: float, epoch: _Epoch, i: int, count: int) -> None:
        if self.t_first is None:
            self.t_first = now
        self.bytes_read += count * BLOCK_SIZE
        if i > epoch.cursor:
            epoch.cursor = i
        if epoch.issued <= epoch.cursor:
            epoch.issued, epoch.issued_offset = epoch.cursor + 1, 0

    def _end(self, now: float, epoch: _Epoch) -> int:
        depth = HINT_DEPTH_FACTOR * self.ctx.depth_bytes(self.rate(now)) // BLOCK_SIZE
        start = min(epoch.cursor + 1, len(epoch))
        return min(bisect.bisect_left(epoch.cum, epoch.cum[start] + depth) + 1, len(epoch))

    def register(self, now: float) -> None:
        if not self.epochs:
            return
        epoch = self.epochs[0]
        end = self._end(now, epoch)
        rate = self.ctx.rate(self.rate(now))
        base = epoch.cum[epoch.cursor + 1]
        for i in range(max(epoch.registered, epoch.cursor + 1), end):
            file_id, first, stop = epoch.item(i)
            ahead = (epoch.cum[i] - base) * BLOCK_SIZE / rate
            self.ctx.register(now, HINTED, file_id, first, stop, ahead)
        epoch.registered = max(epoch.registered, end)

    def peek(self, now: float) -> tuple[float, str, float] | None:
        if not self.epochs:
            return None
        epoch = self.epochs[0]
        if epoch.issued >= self._end(now, epoch):
            return None
        ahead = (epoch.cum[epoch.issued] - epoch.cum[epoch.cursor + 1]) * BLOCK_SIZE
        return now + max(ahead, 0) / self.ctx.rate(self.rate(now)), HINTED, 1.0

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        if not self.epochs:
            return None
        epoch = self.epochs[0]
        if epoch.issued >= len(epoch):
            return None
        file_id, first, stop = epoch.item(epoch.issued)
        a = first + epoch.issued_offset
        b = min(stop, a + max_blocks)
        if b >= stop:
            epoch.issued, epoch.issued_offset = epoch.issued + 1, 0
        else:
            epoch.issued_offset = b - first
        return file_id, a, b, HINTED


class HintedPredictor:
    """Turns hint records into per-announcer sequences and follows reads through them."""

    name = HINTED

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.sequences: dict[str, HintSequence] = {}
        self.unknown_paths = 0

    def on_hints(self, now: float, record: HintRecord) -> None:
        """Append a record's items to its announcer's epoch (a new epoch number starts one)."""
        seq = self.sequences.get(record.source)
        if seq is None:
            seq = self.sequences[record.source] = HintSequence(self.ctx, record.source)
        if not seq.epochs or seq.epochs[-1].epoch != record.epoch:
            seq.epochs.append(_Epoch(record.epoch))
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
        seq.register(now)
        self.ctx.planner.offer(seq)

    def observe(self, now: float, file_id: int, first: int, count: int) -> None:
        for seq in self.sequences.values():
            if seq.match(now, file_id, first, count):
                seq.register(now)
                self.ctx.planner.offer(seq)
