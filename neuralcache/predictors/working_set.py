"""Working-set fill: when reads look random but the files they touch fit in the cache, fetch them.

Two kinds of randomness call for it. Random reads inside files (a shuffled sampler over packed
shards): fill the rest of the touched files, densest first (most reads per byte still missing).
Whole files read in a shuffled order (tar shards, a small-file data set): within a pass every
sibling not yet read is still to come, so fetch the heads of unread siblings first (the first
read of the next file then hits), then the rest of them. Fill only uses free cache space and the
link capacity left over by everything nearer (the planner treats it as a far-off guess), and it
is scored on what it fetches like any other predictor.
"""

from __future__ import annotations

from collections import deque

from neuralcache.blocks import BLOCK_SIZE
from neuralcache.events import CacheView
from neuralcache.predictors.base import Context
from neuralcache.streams import Observation

FILL = "fill"
HEADS = "heads"

RANDOM_GAIN = 0.02
"""EWMA weight of one read in the share of random reads (about the last 50 reads count, so a
learned predictor gets a chance before the fill starts)."""

RANDOM_THRESHOLD = 0.5
"""Above this share of random reads, touched files are filled."""

START_HISTORY = 8
"""File starts remembered to judge whether files are read in name order."""

SHUFFLED_THRESHOLD = 0.5
"""More than this share of file starts that did not follow name order means a shuffled order."""

FIT_SHARE = 0.9
"""The fill set must fit in this share of the cache (the rest is for other files and guesses)."""

HEAD_BYTES = 512 * 1024
"""Head of an unread file fetched first: covers the first reads at the start of a shard."""

FAR_HORIZONS = 4.0
"""Fill ranges are due this many horizons out: later than any near guess, and only free space."""

REORDER_EVERY = 64
"""Reads between recomputations of the fill order."""

FILL_TTL_S = 120.0
"""A filled block counts as useful if read within this long (an epoch or two)."""


class WorkingSetFill:
    """Watches how random the reads are and walks an ordered list of files to fill.

    The fill order is a list of file ids (recomputed every ``REORDER_EVERY`` reads); in the
    "unread" mode it is walked twice, heads first, then whole files.
    """

    name = FILL

    def __init__(self, ctx: Context, cache: CacheView) -> None:
        self.ctx = ctx
        self.cache = cache
        self.randomness = 0.0
        self._starts: deque[int] = deque(maxlen=START_HISTORY)  # 1 = start not in name order
        self.touches: dict[int, int] = {}
        self.started: set[int] = set()  # files whose start was read in this pass
        self.filled: dict[int, int] = {}  # file -> blocks below this are done (fetched or cached)
        self.mode = ""  # "", "unread" or "touched"
        self._order: list[int] = []
        self._phase = 0  # 0: heads (unread mode only), 1: whole files
        self._next = 0
        self._reads = 0

    @property
    def shuffled(self) -> bool:
        """True when whole files are being started in an order other than name order."""
        starts = self._starts
        return len(starts) >= 3 and sum(starts) > SHUFFLED_THRESHOLD * len(starts)

    def observe(self, now: float, obs: Observation, predicted: bool) -> None:
        """``predicted``: a pattern predictor (not the fill itself) had guessed this read."""
        fid = obs.stream.file_id
        new = obs.delta is None
        # Random: nobody predicted it, and it neither starts a file nor continues a run.
        random = not (predicted or obs.explained) and ((obs.first > 0) if new else (
            obs.stream.run == 0 and obs.crossed_from is None))
        self.randomness += RANDOM_GAIN * (float(random) - self.randomness)
        if obs.first == 0 and (new or obs.crossed_from is not None):
            self._starts.append(1 if new else 0)
            if fid in self.started:
                self.started.clear()  # a file started twice: a new pass over the set
            self.started.add(fid)
        self.touches[fid] = self.touches.get(fid, 0) + 1
        self._reads += 1
        if self._reads % REORDER_EVERY == 0 or (self._reads < REORDER_EVERY and new):
            self._reorder()
        if self._next < len(self._order):
            self.ctx.planner.offer(self)

    def stand_down(self) -> None:
        """A read the job announced (hints): its order is known, so filling around it only
        takes link and in-flight budget from the announced reads. Drop the current fill; it
        is rebuilt from the reads that come after, if they are not announced."""
        self.mode, self._order, self._next = "", [], 0

    def on_evicted(self, file_id: int, first: int) -> None:
        """Evicted blocks may need filling again."""
        if self.filled.get(file_id, 0) > first:
            self.filled[file_id] = first

    def _reorder(self) -> None:
        catalog = self.ctx.catalog
        capacity = FIT_SHARE * self.cache.capacity_bytes()
        order: list[int] = []
        mode = ""
        if self.shuffled:
            dirs = {catalog.directory(f): f for f in self.started}
            if sum(catalog.directory_bytes(d) for d in dirs if d is not None) <= capacity:
                mode = "unread"
                order = [f for any_fid in dirs.values() for f in catalog.siblings(any_fid)
                         if f not in self.started]
        elif self.randomness >= RANDOM_THRESHOLD:
            if sum(catalog.size(f) for f in self.touches) <= capacity:
                mode = "touched"
                order = sorted(self.touches, key=lambda f: -self.touches[f] / max(
                    catalog.blocks(f) - self.filled.get(f, 0), 1))
        if mode != self.mode or order != self._order:
            self.mode = mode
            self._order = order
            self._phase = 0 if mode == "unread" else 1
            self._next = 0

    def _current(self) -> tuple[int, int, int, str] | None:
        """The next (file, first, stop, source) with something left to fill."""
        catalog = self.ctx.catalog
        while True:
            if self._next >= len(self._order):
                if self._phase == 0:
                    self._phase, self._next = 1, 0
                    continue
                return None
            fid = self._order[self._next]
            stop = catalog.blocks(fid)
            source = FILL
            if self._phase == 0:
                stop = min(stop, HEAD_BYTES // BLOCK_SIZE)
                source = HEADS
            first = self.filled.get(fid, 0)
            if first < stop and (self._phase == 1 or fid not in self.started):
                return fid, first, stop, source
            self._next += 1

    def peek(self, now: float) -> tuple[float, str, float] | None:
        current = self._current()
        if current is None:
            return None
        return now + FAR_HORIZONS * self.ctx.horizon, current[3], 1.0

    def take(self, max_blocks: int) -> tuple[int, int, int, str] | None:
        current = self._current()
        if current is None:
            return None
        fid, first, stop, source = current
        stop = min(stop, first + max_blocks)
        self.filled[fid] = stop
        return fid, first, stop, source
