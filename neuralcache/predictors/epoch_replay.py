"""Epoch replay: remember the order of the first pass, replay it when a later pass retraces it.

Every read that touches a block for the first time is appended to a log, so the log is the first
pass over the data set in the order the loader read it. A read of a block already in the log is a
re-read; when a run of re-reads lands in order near one place in the log (workers reading out of
order by up to a few hundred records are tolerated), a later pass is retracing the first one and
the window replays the log from there. A pass in a new order scatters over the whole log and never
locks on; the lock is also dropped as soon as reads stop following the log.
"""

from __future__ import annotations

import bisect

from neuralcache.blocks import BLOCK_SIZE, block_key
from neuralcache.predictors.base import Context

REPLAY = "replay"

MAX_RECORDS = 2_000_000
"""First-touch reads remembered (a few hundred MB of index at most); later ones are not logged."""

WINDOW_RECORDS = 2048
"""How far (in log records) a re-read may land from the replay cursor and still follow it."""

START_STREAK = 16
"""In-order re-reads needed before replay starts (random hits fall inside the window rarely)."""

MATCH_GAIN = 0.05
"""EWMA weight of one read in the share of reads that follow the log."""

MIN_MATCH = 0.5
"""Replay stops when fewer reads than this follow the log."""


class EpochReplay:
    """The log, the lock-on state and the replay window (it is its own planner window)."""

    name = REPLAY

    def __init__(self, ctx: Context, max_records: int = MAX_RECORDS) -> None:
        self.ctx = ctx
        self.max_records = max_records
        self.files: list[int] = []
        self.firsts: list[int] = []
        self.lengths: list[int] = []
        self.cum: list[int] = [0]  # blocks logged before record i
        self._seen: dict[int, int] = {}  # block key of a logged read's first block -> record
        self.active = False
        self.cursor = -1  # furthest record re-read in the current pass
        self._candidate = -1
        self._streak = 0
        self.match = 0.0
        self.issued = 0  # next record to hand out
        self._issued_offset = 0  # blocks of that record already handed out
        self._registered = 0
        self._rate = 1.0
        self._end_key: tuple[int, int, float, float, int] | None = None  # _end's inputs ...
        self._end_value = 0  # ... and its answer for them

    def __len__(self) -> int:
        return len(self.files)

    def _window(self) -> int:
        return max(START_STREAK, min(WINDOW_RECORDS, len(self.files) // 8))

    def observe(self, now: float, file_id: int, first: int, count: int, rate: float) -> None:
        """Log a first touch, or follow/lock onto the log on a re-read."""
        self._rate = max(rate, 1.0)
        key = block_key(file_id, first)
        index = self._seen.get(key)
        if index is None:
            if len(self.files) < self.max_records:
                self._seen[key] = len(self.files)
                self.files.append(file_id)
                self.firsts.append(first)
                self.lengths.append(count)
                self.cum.append(self.cum[-1] + count)
            return
        window = self._window()
        if self.active:
            if self.cursor - window <= index <= self.cursor + window:
                self.match += MATCH_GAIN * (1.0 - self.match)
                self._advance_to(index)
            else:
                self.match -= MATCH_GAIN * self.match
                if self.match < MIN_MATCH:
                    self.active = False
                    self._streak = 0
        elif self._candidate >= 0 and abs(index - self._candidate) <= window:
            self._candidate = max(self._candidate, index)
            self._streak += 1
            if self._streak >= START_STREAK:
                self.active = True
                self.match = 1.0
                self.cursor = -1
                self.issued = self._registered = self._candidate + 1
                self._issued_offset = 0
                self._advance_to(self._candidate)
        else:
            self._candidate = index
            self._streak = 1
        if self.active:
            self._register(now)
            if self.issued < self._end():
                self.ctx.planner.offer(self)

    def _advance_to(self, index: int) -> None:
        if index > self.cursor:
            self.cursor = index
        if self.issued <= self.cursor:
            self.issued, self._issued_offset = self.cursor + 1, 0

    def _end(self) -> int:
        """One past the last record inside the window (the window covers the depth in bytes).

        Asked several times per read (register, offer, peek, take) with the same inputs, so
        the last answer is kept with them."""
        ctx = self.ctx
        key = (self.cursor, len(self.files), self._rate, ctx.horizon, ctx.min_depth)
        if key == self._end_key:
            return self._end_value
        depth_blocks = ctx.depth_bytes(self._rate) // BLOCK_SIZE
        start = min(self.cursor + 1, len(self.files))
        end = min(bisect.bisect_left(self.cum, self.cum[start] + depth_blocks) + 1,
                  len(self.files))
        self._end_key, self._end_value = key, end
        return end

    def _register(self, now: float) -> None:
        end = self._end()
        base = self.cum[self.cursor + 1]
        for i in range(max(self._registered, self.cursor + 1), end):
            ahead = (self.cum[i] - base) * BLOCK_SIZE / self._rate
            self.ctx.register(now, REPLAY, self.files[i], self.firsts[i],
                              self.firsts[i] + self.lengths[i], ahead)
        self._registered = max(self._registered, end)

    def peek(self, now: float) -> tuple[float, str, float] | None:
        if not self.active or self.issued >= self._end():
            return None
        ahead = (self.cum[self.issued] - self.cum[self.cursor + 1]) * BLOCK_SIZE
        return now + max(ahead, 0) / self._rate, REPLAY, self.match

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        if not self.active or self.issued >= self._end():
            return None
        i = self.issued
        first = self.firsts[i] + self._issued_offset
        stop = min(self.firsts[i] + self.lengths[i], first + max_blocks)
        if stop >= self.firsts[i] + self.lengths[i]:
            self.issued, self._issued_offset = i + 1, 0
        else:
            self._issued_offset = stop - self.firsts[i]
        return self.files[i], first, stop, REPLAY
