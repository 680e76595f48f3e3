"""What every predictor shares: the catalog, the ledger that scores it, and the depth rule."""

from __future__ import annotations

from neuralcache.catalog import Catalog
from neuralcache.ensemble import Ledger
from neuralcache.events import CacheView
from neuralcache.planner import Planner

MIN_DEPTH_BYTES = 256 * 1024
"""Shallowest window, before a stream's rate is known (twice the kernel's default readahead)."""

MAX_DEPTH_BYTES = 64 * 1024 * 1024
"""Deepest window of one stream; past this a guess ties up cache for too long."""

LEDGER_TTL_MIN_S = 2.0
"""A guess counts as right if read within this long (or a few horizons, if longer): a window
reaches one horizon ahead, so a block read much later than that was not predicted, just hit
by chance (which a random guess over a small data set would be, given long enough)."""

LEDGER_TTL_HORIZONS = 4.0

RAMP_START_BYTES = 128 * 1024
"""Window of a run that has not yet continued (a read at a file's start): kernel-sized."""

RAMP_FACTOR = 4
"""Each read that continues a run multiplies its window, up to the link-adapted depth: a run
proves itself in a few reads, and one coincidental match costs little."""


class Context:
    """Shared state handed to predictors; the facade refreshes ``horizon`` and ``min_depth``."""

    __slots__ = ("catalog", "cache", "ledger", "planner", "horizon", "min_depth", "ttl",
                 "read_rate")

    def __init__(self, catalog: Catalog, cache: CacheView, ledger: Ledger, planner: Planner
                 ) -> None:
        self.catalog = catalog
        self.cache = cache
        self.ledger = ledger
        self.planner = planner
        self.horizon = 0.0  # seconds ahead of a reader that a window must reach
        self.min_depth = MIN_DEPTH_BYTES
        self.ttl = LEDGER_TTL_MIN_S
        self.read_rate = 0.0  # bytes/s read through the whole mount, measured by the facade

    def set_horizon(self, horizon: float, bdp_bytes: int) -> None:
        """Depth adapts to the link: a window covers ``horizon`` of reading, at least one BDP."""
        self.horizon = horizon
        self.min_depth = min(max(MIN_DEPTH_BYTES, bdp_bytes), MAX_DEPTH_BYTES)
        self.ttl = max(LEDGER_TTL_MIN_S, LEDGER_TTL_HORIZONS * horizon)

    def rate(self, stream_rate: float) -> float:
        """Read rate to plan a window with: the reader's own once measured, else the mount's.

        Workers sharing a file make many short streams (one per batch) whose own rate is never
        measured while the file's frontier advances at the mount's rate, so an unmeasured
        stream is planned at the mount's rate; a long-lived one (a worker reading a whole
        shard) at its own, so its window is not deeper than it reads in a horizon.
        """
        return stream_rate if stream_rate > 0 else max(self.read_rate, 1.0)

    def depth_bytes(self, rate: float, run: int | None = None) -> int:
        """How far ahead (in bytes of this reader's reads) a window must reach.

        ``run`` (reads that continued the pattern so far) ramps the window up from
        ``RAMP_START_BYTES``; None means the pattern is known (hints, replay).
        """
        depth = int(min(max(self.rate(rate) * self.horizon, self.min_depth), MAX_DEPTH_BYTES))
        if run is not None:
            depth = min(depth, RAMP_START_BYTES * RAMP_FACTOR ** min(run, 8))
        return depth

    def register(self, now: float, source: str, file_id: int, first: int, stop: int,
                 ahead_s: float = 0.0) -> None:
        """Shadow-score a guess (whether or not it will be fetched); cached blocks are no guess
        (with several workers, a stream's continuation is often read by another one first).
        ``ahead_s`` is how long until the reader is expected to get there (deep windows)."""
        for a, b in self.planner.unknown_runs(file_id, first, stop):
            self.ledger.register(now, self.ttl + ahead_s, source, file_id, a, b)
