"""The facade the mount calls: reads and hints in, prefetch requests out. Pure and clock-free.

Per read: score outstanding guesses, assign the read to a stream, let every predictor update its
window, then let the planner issue what the budgets allow. Everything here is O(blocks in the
read) plus a handful of dict operations, so it can run on every FUSE read.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuralcache.blocks import BLOCK_SIZE, block_span
from neuralcache.catalog import Catalog
from neuralcache.ensemble import Ledger
from neuralcache.events import AccessEvent, CacheView, LinkEstimate, PrefetchRequest
from neuralcache.hints import HintRecord
from neuralcache.planner import Planner, PrefetchStats
from neuralcache.predictors.base import Context
from neuralcache.predictors.epoch_replay import REPLAY, EpochReplay
from neuralcache.predictors.hinted import HINTED, HintedPredictor
from neuralcache.predictors.sequence_model import NGRAM, SequenceModelPredictor
from neuralcache.predictors.stride import NEXTFILE, STRIDE, StridePredictor
from neuralcache.predictors.working_set import FILL, FILL_TTL_S, HEADS, WorkingSetFill
from neuralcache.streams import MAX_STREAMS, StreamTable

SOURCES = [STRIDE, NEXTFILE, NGRAM, REPLAY, HINTED, HEADS, FILL]

BACKGROUND = frozenset({FILL, HEADS})
"""The working-set fill's sources: guesses over the whole working set, not a reader's next
reads. Scored on what they fetch, not a sign that a read followed a pattern, and their windows'
cached blocks are not paged in."""

RATE_WINDOW_S = 0.5
"""The aggregate read rate (used by replay) is re-measured over windows of this length."""


@dataclass(frozen=True)
class PrefetchConfig:
    """Which predictors run, and how far ahead of the link's lead time windows reach."""

    stride: bool = True
    sequence_model: bool = True
    epoch_replay: bool = True
    working_set: bool = True
    hints: bool = True
    max_streams: int = MAX_STREAMS
    lead_safety: float = 2.0  # horizon = lead_safety x (RTT + time to drain the in-flight budget)

    @classmethod
    def stride_only(cls) -> "PrefetchConfig":
        """The stride/sequential predictor alone (a baseline)."""
        return cls(sequence_model=False, epoch_replay=False, working_set=False, hints=False)


class Prefetcher:
    """See the module docstring; the mount drives it from its event loop."""

    def __init__(self, catalog: Catalog, cache: CacheView, config: PrefetchConfig | None = None,
                 link: LinkEstimate | None = None) -> None:
        self.catalog = catalog
        self.config = config or PrefetchConfig()
        self.ledger = Ledger(SOURCES)
        # Sources whose guesses mean "this read followed a pattern" (the fill's own do not).
        self._pattern_mask = sum(self.ledger.bit(s) for s in SOURCES if s not in BACKGROUND)
        self.planner = Planner(cache, self.ledger, dict.fromkeys(BACKGROUND, FILL_TTL_S),
                               unhurried=BACKGROUND)
        self.ctx = Context(catalog, cache, self.ledger, self.planner)
        self.streams = StreamTable(catalog, self.config.max_streams)
        cfg = self.config
        self._stream_predictors: list[StridePredictor | SequenceModelPredictor] = []
        if cfg.stride:
            self._stream_predictors.append(StridePredictor(self.ctx))
        if cfg.sequence_model:
            self._stream_predictors.append(SequenceModelPredictor(self.ctx))
        self.replay = EpochReplay(self.ctx) if cfg.epoch_replay else None
        self.hinted = HintedPredictor(self.ctx) if cfg.hints else None
        self.fill = WorkingSetFill(self.ctx, cache) if cfg.working_set else None
        self._rate = 0.0
        self._rate_mark = (0.0, 0)
        self._started: float | None = None
        self.set_link(link)

    # inputs --------------------------------------------------------------------------------
    def set_link(self, link: LinkEstimate | None) -> None:
        """New bandwidth/RTT estimate: resizes the in-flight budget and every window's depth."""
        self.planner.link = link
        if link is None:
            self.ctx.set_horizon(0.0, 0)
            return
        horizon = self.config.lead_safety * self.planner.lead_time()
        self.ctx.set_horizon(horizon, int(link.bandwidth * link.min_rtt))

    def on_access(self, now: float, event: AccessEvent) -> list[PrefetchRequest]:
        """A read was served or requested; returns prefetches to start now."""
        self.observe(now, event)
        return self._plan(now)

    def observe(self, now: float, event: AccessEvent) -> None:
        """``on_access`` without the plan: a caller with several events at hand (the mount's
        pump) hands them all over and then plans once (``plan``)."""
        first, stop = block_span(event.offset, event.length)
        if stop <= first:
            return
        guessed = self.ledger.on_read(now, event.file_id, first, stop)
        self.planner.on_read(event.file_id, first, stop)
        self._measure_rate(now, (stop - first) * BLOCK_SIZE)
        self.ctx.read_rate = self._rate
        if self.hinted is not None and self.hinted.observe(now, event.file_id, first,
                                                           stop - first):
            # An announced read: its order is known, and the stream table, the stream
            # predictors and replay would learn nothing the hints do not say (in a shuffled
            # epoch every read made a stream of its own, most of the work per read).
            if self.fill is not None:
                self.fill.stand_down()
        else:
            obs = self.streams.observe(now, event.stream, event.file_id, event.offset,
                                       event.length)
            for predictor in self._stream_predictors:
                predictor.observe(now, obs)
            if self.replay is not None:
                self.replay.observe(now, event.file_id, first, stop - first, self._rate)
            if self.fill is not None:
                self.fill.observe(now, obs, bool(guessed & self._pattern_mask))
        self.ledger.expire(now)

    def on_hints(self, now: float, record: HintRecord) -> list[PrefetchRequest]:
        """A decoded hint record from the control file; returns prefetches to start now."""
        if self.hinted is None:
            return []
        self.hinted.on_hints(now, record)
        return self._plan(now)

    def on_prefetch_complete(self, now: float, request: PrefetchRequest, ok: bool = True
                             ) -> list[PrefetchRequest]:
        """A prefetch arrived (or failed); the freed budget may start more."""
        self.complete(now, request, ok)
        return self._plan(now)

    def complete(self, now: float, request: PrefetchRequest, ok: bool = True) -> None:
        """``on_prefetch_complete`` without the plan (see ``observe``)."""
        self.planner.on_complete(now, request, ok)

    def take_present(self) -> list[tuple[int, int, int]]:
        """(file, first block, stop) stretches of windows that are cached or in flight, each
        reported once per ``planner.PRESENT_RENOTE_S``: the mount asks its disk for the cached ones
        ahead of the reader."""
        return self.planner.take_present()

    def on_evicted(self, file_id: int, first: int, count: int = 1) -> None:
        """The cache evicted blocks ``[first, first + count)`` of a file."""
        self.planner.on_evicted(file_id, first, first + count)
        if self.fill is not None:
            self.fill.on_evicted(file_id, first)

    def plan(self, now: float, link: LinkEstimate | None = None) -> list[PrefetchRequest]:
        """Periodic tick (and link updates): drop expired guesses, issue what now fits."""
        if link is not None:
            self.set_link(link)
        self.ledger.expire(now)
        return self._plan(now)

    def _plan(self, now: float) -> list[PrefetchRequest]:
        """Every plan: the hinted windows that reads moved are extended first."""
        if self.hinted is not None:
            self.hinted.register_moved(now)
        return self.planner.plan(now, self.ctx.horizon)

    # outputs -------------------------------------------------------------------------------
    def is_protected(self, file_id: int, block: int) -> bool:
        """The cache should not evict this block: it was prefetched and is about to be read."""
        return self.planner.is_protected(file_id, block)

    def settled(self) -> bool:
        """No prefetch is on its way and every prefetched block has been read or written off
        (``Planner.settled``)."""
        return self.planner.settled()

    def stats(self) -> PrefetchStats:
        """Issued/useful/late/wasted counts (blocks; ``*_bytes`` properties for bytes)."""
        return self.planner.stats()

    def accuracy(self) -> dict[str, float]:
        """Measured accuracy of each predictor (what the ensemble weights guesses by)."""
        return dict(self.ledger.accuracy)

    def _measure_rate(self, now: float, nbytes: int) -> None:
        if self._started is None:
            self._started = now
            self._rate_mark = (now, 0)
        t0, acc = self._rate_mark
        acc += nbytes
        elapsed = now - t0
        if elapsed >= RATE_WINDOW_S:
            inst = acc / elapsed
            self._rate = inst if self._rate == 0 else 0.5 * (self._rate + inst)
            self._rate_mark = (now, 0)
        else:
            self._rate_mark = (t0, acc)
            if self._rate == 0:
                self._rate = acc / RATE_WINDOW_S
