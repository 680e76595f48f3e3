"""CUBIC (RFC 8312) over request-sized segments: the loss-based controller BBR is compared with.

cwnd is kept in bytes; the cubic function runs in segments of `mss` bytes. Slow start, the
cubic and Reno-friendly regions, fast convergence, and one multiplicative decrease per
recovery period (losses of requests sent before the last decrease are the same congestion
event). HyStart and the RTO collapse to one segment are left out (docs/congestion.md).
"""

from __future__ import annotations

import math

from .base import DEFAULT_INITIAL_RTT, DEFAULT_MSS, CongestionStats, SampledController

SLOW_START = "slow_start"
"""``Cubic.state`` while cwnd is below ssthresh: its start-up (``CongestionStats.starting``)."""

BETA = 0.7
"""Multiplicative decrease factor (RFC 8312 beta_cubic)."""

C = 0.4
"""Cubic scaling constant, segments / s^3 (RFC 8312)."""

RENO_FRIENDLY_ALPHA = 3 * (1 - BETA) / (1 + BETA)
"""Additive increase per RTT that makes an AIMD(alpha, BETA) flow as aggressive as Reno."""

MAX_GROWTH_PER_RTT = 1.5
"""Cap on the cubic target relative to the current cwnd (RFC 8312 section 4.1)."""

PACING_SS_RATIO = 2.0
"""Pacing rate / (cwnd / srtt) in slow start (Linux tcp_pacing_ss_ratio = 200 %)."""

PACING_CA_RATIO = 1.2
"""Pacing rate / (cwnd / srtt) in congestion avoidance (Linux tcp_pacing_ca_ratio = 120 %)."""


class Cubic(SampledController):
    """Sans-IO CUBIC with the same interface as BBR; pacing follows Linux's cwnd/srtt rule."""

    name = "cubic"

    def __init__(
        self, *, initial_rtt: float = DEFAULT_INITIAL_RTT, mss: int = DEFAULT_MSS
    ) -> None:
        super().__init__(initial_rtt=initial_rtt, mss=mss)
        self.ssthresh: float = math.inf  # bytes
        self._w_max = 0.0  # segments: cwnd just before the last decrease (or its FC-reduced value)
        self._w_last_max = 0.0  # segments: previous W_max, for fast convergence
        self._origin = 0.0  # segments: plateau of the current cubic curve
        self._k = 0.0  # seconds from the epoch start to the plateau
        self._w_est = 0.0  # segments: Reno-friendly estimate
        self._epoch_start: float | None = None
        self._recovery_start: float | None = None
        self._in_recovery = False
        self._update_pacing_rate()

    @property
    def state(self) -> str:
        if self._in_recovery:
            return "recovery"
        return SLOW_START if self._cwnd < self.ssthresh else "congestion_avoidance"

    def stats(self) -> CongestionStats:
        state = self.state
        return self._stats(state=state, starting=state == SLOW_START,
                           btl_bw=self.sampler.latest_rate, min_rtt=self.sampler.min_rtt)

    def on_packet_sent(self, now: float, packet_id: int, nbytes: int) -> None:
        self.sampler.on_sent(now, packet_id, nbytes)

    def on_packet_acked(self, now: float, packet_id: int) -> None:
        rs = self.sampler.on_acked(now, packet_id)
        packet = rs.packet
        if self._in_recovery and self._recovery_start is not None:
            if packet.sent_time > self._recovery_start:
                self._in_recovery = False  # a request sent after the decrease got through
        # Grow only while the window is what limits sending (not the application).
        if not self._in_recovery and not rs.is_app_limited:
            if self._cwnd < self.ssthresh:
                self._cwnd += packet.nbytes
            else:
                self._congestion_avoidance(now, packet.nbytes)
        self._update_pacing_rate()

    def on_packet_lost(self, now: float, packet_id: int) -> None:
        packet = self.sampler.on_lost(packet_id)
        if self._recovery_start is not None and packet.sent_time <= self._recovery_start:
            return  # same congestion event as the last decrease
        self._decrease(now)

    def on_path_loss(self, now: float, nbytes: int) -> None:
        """TCP resent ``nbytes`` below the requests: to a loss-based control that is loss, and
        the requests would never show it (TCP repairs it), so it is a congestion event here, at
        most one per smoothed round trip. Without it, a hub whose kernel only follows the
        spoke's pacing (``nc_paced``) was driven ever faster into an overflowing queue."""
        if nbytes <= 0:
            return
        if self._recovery_start is not None and now - self._recovery_start < self._srtt():
            return  # same congestion event as the last decrease
        self._decrease(now)

    def _decrease(self, now: float) -> None:
        """A congestion event: the multiplicative decrease, remembered as of ``now``."""
        self._recovery_start = now
        self._in_recovery = True
        cwnd_seg = self._cwnd / self.mss
        if cwnd_seg < self._w_last_max:
            # Fast convergence: the flow is losing ground, release bandwidth to newcomers.
            self._w_last_max = cwnd_seg
            self._w_max = cwnd_seg * (1 + BETA) / 2
        else:
            self._w_max = self._w_last_max = cwnd_seg
        self.ssthresh = max(int(self._cwnd * BETA), self.min_cwnd)
        self._cwnd = int(self.ssthresh)
        self._epoch_start = None
        self._update_pacing_rate()

    def _congestion_avoidance(self, now: float, acked: int) -> None:
        cwnd_seg = self._cwnd / self.mss
        acked_seg = acked / self.mss
        if self._epoch_start is None:
            self._epoch_start = now
            if cwnd_seg < self._w_max:
                self._k = ((self._w_max - cwnd_seg) / C) ** (1 / 3)
                self._origin = self._w_max
            else:
                self._k = 0.0
                self._origin = cwnd_seg
            self._w_est = cwnd_seg
        rtt = self.sampler.min_rtt
        t = now - self._epoch_start + rtt
        target = self._origin + C * (t - self._k) ** 3
        target = min(max(target, cwnd_seg), MAX_GROWTH_PER_RTT * cwnd_seg)
        cubic_cwnd = cwnd_seg + (target - cwnd_seg) / cwnd_seg * acked_seg
        self._w_est += RENO_FRIENDLY_ALPHA * acked_seg / cwnd_seg
        self._cwnd = max(int(max(cubic_cwnd, self._w_est) * self.mss), self.min_cwnd)

    def _srtt(self) -> float:
        """The smoothed round trip, or the initial guess until one is measured."""
        return self.sampler.srtt if math.isfinite(self.sampler.srtt) else self.initial_rtt

    def _update_pacing_rate(self) -> None:
        ratio = PACING_SS_RATIO if self._cwnd < self.ssthresh / 2 else PACING_CA_RATIO
        self._pacing_rate = ratio * self._cwnd / self._srtt()
