"""Token-bucket pacer that spaces request sends at a controller's pacing rate.

Kept apart from the controllers (like aioquic's QuicPacketPacer) so either controller can drive
it and the fetcher owns the timing. Tokens are bytes refilled at `rate`, capped at the
bucket's `capacity` (`burst` bytes, or `burst_seconds` at the rate if that is more). A request
may go once the bucket holds min(nbytes, burst) tokens and then costs all its bytes, so the
balance can go negative: a request larger than that is not blocked forever, it only delays
the ones after it. Hence, over any interval of length T, bytes sent <= max(burst, largest
request) + rate * T while the capacity is `burst`, and <= capacity + largest request +
rate * T when it is more. A sender that comes back later than the time it was told keeps
the tokens of that lateness, up to `late_credit` seconds of them, beyond the cap: the bounds
grow by `rate * late_credit`.
"""

from __future__ import annotations

import math

from .base import DEFAULT_MSS

DEFAULT_BURST = 2 * DEFAULT_MSS
"""Default bucket size in bytes: two minimum-size requests may leave back to back."""

BURST_SECONDS = 0.002
"""The bucket also holds this long at the current rate, when that is more than `burst` (at
rates above 64 MB/s with the default burst), like Linux's TSO autosizing, which sends about
1 ms of data at the pacing rate per burst. The trio shell that waits for `next_send_time`
wakes a millisecond or so late at random, and tokens beyond the cap are thrown away: at
1 GB/s (loopback) a 128 KiB bucket lasts 0.13 ms, and the BBR-paced pool moved 0.68 GB/s
where one under a controller that did not limit it moved 1.35 (`python -m bench.transport
--loopback-only --clients bbr cubic`, one run)."""

LATE_CREDIT_SECONDS = 0.010
"""How late a sender may come back after the time `next_send_time` named and still send as if
it had come on time. The trio shell that waits for that time wakes late whenever the event
loop is busy (a millisecond on average in a cold I/O-bound run of `bench.repro` at 200 Mbit/s,
more at times: `neuralcache_fabric_prefetch_dispatch_wait_seconds_total{reason="pacer_late"}`
was 12-18 % of the run). A send waits until the bucket holds `burst` (its request is larger),
which at that rate is also the cap, so without this every late wake-up lost its time at the
rate. Only lateness is credited: idle time refills the bucket to its cap and no further, so a
sender that had nothing to send does not come back with a larger burst (one told a time that
then sent nothing keeps at most the same 10 ms)."""

SLACK_BYTES = 1.0
"""A send may go this many bytes early so float rounding of a wake-up time cannot spin."""


class Pacer:
    """Sans-IO token bucket: ask `next_send_time`, wait until then, call `on_sent`."""

    def __init__(self, rate: float, *, burst: int = DEFAULT_BURST,
                 burst_seconds: float = BURST_SECONDS,
                 late_credit: float = LATE_CREDIT_SECONDS) -> None:
        if burst <= 0:
            raise ValueError(f"burst must be positive, got {burst}")
        if burst_seconds < 0 or late_credit < 0:
            raise ValueError(f"burst_seconds and late_credit must not be negative, got "
                             f"{burst_seconds} and {late_credit}")
        self.burst = burst
        self.burst_seconds = burst_seconds
        self.late_credit = late_credit
        self._rate = self._checked(rate)
        self._tokens = float(burst)
        self._stamp: float | None = None  # when _tokens was last brought up to date
        self._due: float | None = None  # the time a waiting send was told, until it goes

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def capacity(self) -> float:
        """Tokens the bucket holds at most, in bytes, at the current rate: what a late
        sender may catch up by."""
        return max(float(self.burst), self._rate * self.burst_seconds)

    def update_rate(self, rate: float, now: float | None = None) -> None:
        """Set a new rate; pass `now` so that the time elapsed so far refills at the old rate."""
        rate = self._checked(rate)
        if now is not None:
            self._tokens = self._tokens_at(now)
            self._stamp = now
        self._rate = rate

    def next_send_time(self, now: float, nbytes: int) -> float:
        """Earliest time (>= now) at which a request of `nbytes` may be sent."""
        deficit = min(nbytes, self.burst) - self._tokens_at(now)
        if deficit <= SLACK_BYTES:
            return now
        self._due = now + deficit / self._rate
        return self._due

    def on_sent(self, now: float, nbytes: int) -> None:
        self._tokens = self._tokens_at(now) - nbytes
        self._stamp = now
        self._due = None

    def _tokens_at(self, now: float) -> float:
        if self._stamp is None:
            return self._tokens
        elapsed = max(0.0, now - self._stamp)
        cap = self.capacity
        if self._due is not None and now > self._due:
            cap += self._rate * min(self.late_credit, now - self._due)
        return min(cap, self._tokens + elapsed * self._rate)

    @staticmethod
    def _checked(rate: float) -> float:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"pacing rate must be positive and finite, got {rate}")
        return float(rate)
