"""How much of what the path delivered lately the hub's TCP had to send twice (sans-IO).

TCP repairs every segment loss below our requests, so the spoke learns of loss only from the
hub's reports (protocol version 3: each read reply carries the bytes its connection resent).
``ResendRate`` sets them against the reply bytes that arrived over the last ``window`` seconds:
on a clean path it is 0, at 1 % random loss about 0.01. The client hedges small demand reads
and keeps prefetch chunks small only while it is above ``LOSSY_RESENT_RATIO``, so a clean path
does not pay for every such read twice. ``SteadyLoss`` asks the same once the start-up's own
losses are past: the client keeps more bulk connections on a path that loses segments then.
"""

from __future__ import annotations

import math
from collections import deque

RESEND_WINDOW_S = 10.0
"""Seconds of history the ratio covers: long enough to hold a few losses at 0.1 %, short
enough that a burst of tail drops during start-up is forgotten soon after."""
BUCKET_S = 1.0
"""Granularity of the history: the window slides a bucket at a time."""

LOSSY_RESENT_RATIO = 0.001
"""The path counts as lossy while the hub's TCP has lately resent at least this share of the
bytes delivered. Then small demand reads are hedged: at 1 % random loss a second copy saves a
demand read the retransmission's round trip; on a clean path it only doubled the bytes of
every small miss (a cold shuffled ``bench.repro`` run moved 604-617 MB over the WAN hedged,
559 MB not). And prefetch chunks stay small (``request_pipe.chunk_bytes``)."""


class ResendRate:
    """Resent bytes over delivered bytes, over the last ``window`` seconds."""

    def __init__(self, window: float = RESEND_WINDOW_S, bucket: float = BUCKET_S) -> None:
        self._window = window
        self._bucket = bucket
        self._buckets: deque[list[float]] = deque()  # [start, delivered, resent], oldest first
        self._delivered = 0.0
        self._resent = 0.0

    def on_delivered(self, now: float, nbytes: int) -> None:
        """Reply bytes arrived from the hub."""
        self._current(now)[1] += nbytes
        self._delivered += nbytes

    def on_resent(self, now: float, nbytes: int) -> None:
        """The hub reported that its TCP sent ``nbytes`` again."""
        self._current(now)[2] += nbytes
        self._resent += nbytes

    def ratio(self, now: float) -> float:
        """Resent over delivered bytes in the window; 0 while nothing was delivered in it."""
        delivered, resent = self.totals(now)
        return resent / delivered if delivered > 0 else 0.0

    def lossy(self, now: float) -> bool:
        """Whether the path is lately losing segments (``LOSSY_RESENT_RATIO``)."""
        return self.ratio(now) >= LOSSY_RESENT_RATIO

    def totals(self, now: float) -> tuple[float, float]:
        """(delivered, resent) bytes in the window: everything reported in the last ``window``
        seconds, nothing reported more than ``window + bucket`` seconds ago."""
        self._expire(now)
        return self._delivered, self._resent

    def _current(self, now: float) -> list[float]:
        self._expire(now)
        if not self._buckets or now >= self._buckets[-1][0] + self._bucket:
            self._buckets.append([now, 0.0, 0.0])
        return self._buckets[-1]

    def _expire(self, now: float) -> None:
        buckets = self._buckets
        while buckets and buckets[0][0] + self._bucket <= now - self._window:
            _, delivered, resent = buckets.popleft()
            self._delivered -= delivered
            self._resent -= resent
        if not buckets:  # no float drift left behind
            self._delivered = self._resent = 0.0


SETTLE_S = 2.0
"""Seconds after the controller leaves its start-up before ``SteadyLoss`` counts resends. A
start-up overfills the bottleneck's queue, on a clean path too (60 ms / 200 Mbit/s: ~5,000 tail
drops before it ended, about 1 s in), and the hub reports the repairs over the next round
trips; on that path every resend had been reported by the first look at the controller out of
start-up, none later (``bench.transport --save``'s model samples, every 0.5 s)."""
SETTLE_ROUNDS = 20
"""The same in round trips, for paths where ``SETTLE_S`` is only a few of them."""
STEADY_MIN_RESENT = 64 * 1024
"""Resent bytes (about 45 segments) the window must hold before the path counts as steadily
lossy: a stray drop or two early in the window, over few delivered bytes, is not a loss rate."""


class SteadyLoss:
    """Whether the path loses segments once the controller's start-up has settled.

    ``ResendRate`` counts every resend, and a start-up's overflow makes every path lossy for a
    window after it; here only what the hub reports from ``settle`` seconds (``SETTLE_S``; or
    ``SETTLE_ROUNDS`` round trips if longer) after the start-up on counts, so a clean path
    never reads as lossy. The client feeds it whether the controller is starting up
    (``on_model``) and the same reports as its ``ResendRate``.
    """

    def __init__(self, settle: float = SETTLE_S) -> None:
        self._settle = settle
        self._counts_from: float | None = None  # None while the controller is starting up
        self._rate = ResendRate()

    def on_model(self, now: float, starting: bool, min_rtt: float) -> None:
        """Whether the controller is in its start-up (``CongestionStats.starting``), and its
        min RTT, as of ``now``."""
        if starting:
            self._counts_from = None
            self._rate = ResendRate()
        elif self._counts_from is None:
            rtt = min_rtt if math.isfinite(min_rtt) else 0.0
            self._counts_from = now + max(self._settle, SETTLE_ROUNDS * rtt)

    def _counting(self, now: float) -> bool:
        return self._counts_from is not None and now >= self._counts_from

    def on_delivered(self, now: float, nbytes: int) -> None:
        if self._counting(now):
            self._rate.on_delivered(now, nbytes)

    def on_resent(self, now: float, nbytes: int) -> None:
        if self._counting(now):
            self._rate.on_resent(now, nbytes)

    def lossy(self, now: float) -> bool:
        """The hub's TCP lately resent at least ``STEADY_MIN_RESENT`` bytes and
        ``LOSSY_RESENT_RATIO`` of what was delivered, all after the start-up settled."""
        delivered, resent = self._rate.totals(now)
        return resent >= STEADY_MIN_RESENT and resent >= LOSSY_RESENT_RATIO * delivered
