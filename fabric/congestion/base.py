"""The congestion-controller interface and the delivery-rate sampler every controller shares.

The transport is request/response: a "packet" here is one range-read request, counted by the
size of its response (64 KiB - 4 MiB). It is "sent" when the request goes out and "acked" when
the whole response has arrived, which yields an RTT sample and a delivery-rate sample the way
Linux's tcp_rate.c does (bytes delivered between the send and the ack, over the longer of the
send phase and the ack phase). Everything is sans-IO: callers pass `now` in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DEFAULT_MSS = 64 * 1024
"""Default controller segment: the smallest request the fetcher issues (64 KiB)."""

DEFAULT_INITIAL_RTT = 0.1
"""RTT assumed before the first sample (seconds); only seeds the first pacing rate."""

INITIAL_WINDOW_SEGMENTS = 10
"""Initial cwnd in segments, as Linux's TCP_INIT_CWND."""

MIN_WINDOW_SEGMENTS = 4
"""Smallest cwnd in segments (tcp_bbr.c's bbr_cwnd_min_target): keeps the pipe ticking."""

TIME_RESOLUTION = 1e-6
"""RTTs and rate intervals are rounded to whole microseconds, as the kernel measures them, so a
sample equal to min_rtt is recognised as equal (and refreshes BBR's min_rtt) despite float
noise. Both must be rounded alike: an interval is never shorter than its packet's RTT."""


def _quantize(seconds: float) -> float:
    return round(seconds / TIME_RESOLUTION) * TIME_RESOLUTION


SRTT_GAIN = 1 / 8
"""EWMA gain of the smoothed RTT (RFC 6298's alpha)."""


@dataclass(frozen=True)
class SentPacket:
    """What the sampler remembers about one request in flight (tcp_rate.c's skb->tx)."""

    packet_id: int
    nbytes: int
    sent_time: float
    delivered: int  # connection's delivered bytes when this was sent
    delivered_time: float  # when `delivered` last grew, as of this send
    first_sent_time: float  # send time of the packet that opened the current send phase
    is_app_limited: bool
    arrived: int = 0  # bytes the receiver had got off the path when this was sent
    arrived_time: float | None = None  # when that count was taken (None: nothing counts)


@dataclass(frozen=True)
class RateSample:
    """One delivery-rate and RTT observation, produced when a request completes."""

    packet: SentPacket
    rtt: float  # seconds from request sent to response fully received
    delivered: int  # bytes delivered over `interval`
    interval: float  # seconds; 0 only if acked at the instant it was sent
    prior_delivered: int  # connection's delivered bytes when the packet was sent
    prior_in_flight: int  # bytes in flight just before this ack
    losses: int  # bytes declared lost since the previous ack
    is_app_limited: bool
    arrived: int = 0  # bytes the receiver got off the path between this send and this ack
    arrival_interval: float = 0.0  # seconds between the two counts `arrived` is the difference of

    @property
    def valid(self) -> bool:
        """Whether `delivery_rate` is meaningful (a zero-length interval has no rate)."""
        return self.interval > 0

    @property
    def delivery_rate(self) -> float:
        """Bytes per second over the sample interval, 0 when the sample is not valid."""
        return self.delivered / self.interval if self.valid else 0.0

    @property
    def arrival_rate(self) -> float:
        """Bytes per second that reached the receiver over about this packet's round trip (0
        without counts): what the path carried, however the transport released it."""
        return self.arrived / self.arrival_interval if self.arrival_interval > 0 else 0.0


@dataclass(frozen=True)
class CongestionStats:
    """A snapshot of a controller's model, for metrics and logs."""

    name: str
    state: str
    starting: bool  # in its start-up: its own losses are the queue it overfills, not the path's
    btl_bw: float  # bytes/s: BBR's bottleneck-bandwidth estimate; CUBIC: latest delivery rate
    min_rtt: float  # seconds (inf before the first sample)
    srtt: float  # seconds, smoothed (inf before the first sample)
    pacing_rate: float  # bytes/s
    cwnd: int  # bytes
    bytes_in_flight: int
    delivered_bytes: int
    lost_bytes: int
    lost_packets: int

    @property
    def loss_rate(self) -> float:
        """Fraction of completed-or-lost bytes that were lost, over the connection's life."""
        total = self.delivered_bytes + self.lost_bytes
        return self.lost_bytes / total if total else 0.0


@runtime_checkable
class CongestionController(Protocol):
    """What a fetcher needs from a controller (modelled on aioquic's QuicCongestionControl).

    Each sent packet id must later be reported exactly once, as acked or as lost; a request
    re-issued after a loss is a new packet with a new id.
    """

    name: str

    def on_packet_sent(self, now: float, packet_id: int, nbytes: int) -> None:
        """A request for `nbytes` of response data went out at `now`."""

    def on_packet_acked(self, now: float, packet_id: int) -> None:
        """The whole response to `packet_id` has arrived."""

    def on_packet_lost(self, now: float, packet_id: int) -> None:
        """`packet_id` is given up on (timeout, connection reset)."""

    def on_bytes_delivered(self, now: float, nbytes: int) -> None:
        """`nbytes` that are none of the controller's packets (demand replies) crossed the path."""

    def on_path_loss(self, now: float, nbytes: int) -> None:
        """The transport below resent `nbytes` (TCP repaired a loss the packets never showed)."""

    def on_path_arrivals(self, now: float, nbytes: int) -> None:
        """`nbytes` more reached the receiver off the path, in any order (its kernel's count)."""

    def on_app_limited(self, now: float) -> None:
        """cwnd had room but the application had nothing to request."""

    @property
    def pacing_rate(self) -> float:
        """Bytes per second at which to space request sends (feed it to a Pacer)."""

    @property
    def cwnd(self) -> int:
        """Bytes of response data allowed in flight."""

    @property
    def bytes_in_flight(self) -> int:
        """Bytes sent and neither acked nor lost."""

    def can_send(self, nbytes: int) -> bool:
        """Whether a request of `nbytes` may start now, as far as cwnd is concerned."""

    def stats(self) -> CongestionStats:
        """A snapshot of the controller's model."""


@runtime_checkable
class ResumableController(Protocol):
    """A controller whose model of a path can be kept and started from again (careful resume):
    a spoke's path to its hub rarely changes, and learning it from the initial window takes
    ten round trips or more, 9-13 s at 900 ms."""

    def path_bandwidth(self) -> float | None:
        """The bottleneck bandwidth (bytes/s) once it is worth keeping, else None."""

    def resume(self, now: float, btl_bw: float, rtt: float) -> bool:
        """Start from a kept model (``rtt``: the path's round trip measured now); only before
        anything was delivered. Returns whether it took effect."""


class DeliveryRateSampler:
    """Per-connection delivery accounting and rate samples, after Linux's tcp_rate.c, in bytes.

    tcp_rate.c also discards samples whose interval is shorter than min RTT; they come from
    retransmissions and stretched acks. Here every request is acked on its own and never
    retransmitted (a re-request is a new packet), so interval >= ack phase >= the request's
    own RTT >= min RTT always holds and no such guard is needed.
    """

    def __init__(self) -> None:
        self.delivered = 0
        self.delivered_time = 0.0
        self.lost = 0
        self.lost_packets = 0
        self.bytes_in_flight = 0
        self.min_rtt = math.inf  # all-time minimum RTT
        self.srtt = math.inf
        self.latest_rate = 0.0  # most recent valid delivery rate, for stats
        self._first_sent_time = 0.0
        self._app_limited_until = 0  # tcp_rate.c's tp->app_limited: 0, or a delivered mark
        self._lost_at_last_ack = 0
        self._in_flight: dict[int, SentPacket] = {}
        self.arrived = 0  # bytes the receiver got off the path (``on_arrived``)
        self.arrived_time: float | None = None  # when they were last counted (None: never)

    @property
    def is_app_limited(self) -> bool:
        """True while data sent during an application-limited period is still being acked."""
        return self._app_limited_until != 0

    def mark_app_limited(self) -> None:
        """Mark samples app-limited until everything now in flight has been delivered."""
        self._app_limited_until = (self.delivered + self.bytes_in_flight) or 1

    def on_sent(self, now: float, packet_id: int, nbytes: int) -> SentPacket:
        if packet_id in self._in_flight:
            raise ValueError(f"packet {packet_id} is already in flight")
        if nbytes <= 0:
            raise ValueError(f"packet size must be positive, got {nbytes}")
        if not self._in_flight:
            # Nothing in flight: the next ack measures delivery from this moment on.
            self._first_sent_time = now
            self.delivered_time = now
        packet = SentPacket(
            packet_id=packet_id,
            nbytes=nbytes,
            sent_time=now,
            delivered=self.delivered,
            delivered_time=self.delivered_time,
            first_sent_time=self._first_sent_time,
            is_app_limited=self.is_app_limited,
            arrived=self.arrived,
            arrived_time=self.arrived_time,
        )
        self._in_flight[packet_id] = packet
        self.bytes_in_flight += nbytes
        return packet

    def on_acked(self, now: float, packet_id: int) -> RateSample:
        packet = self._pop(packet_id)
        prior_in_flight = self.bytes_in_flight + packet.nbytes
        self.delivered += packet.nbytes
        self.delivered_time = now
        if self._app_limited_until and self.delivered > self._app_limited_until:
            self._app_limited_until = 0
        self._first_sent_time = max(self._first_sent_time, packet.sent_time)
        # Never below one unit: an ack timed at the instant of its send (a clock coarser than
        # the path, or one that stepped back) would make srtt 0, which both controllers' pacing
        # rates divide by. Its interval stays 0, so its sample carries no rate.
        rtt = max(TIME_RESOLUTION, _quantize(now - packet.sent_time))
        self.min_rtt = min(self.min_rtt, rtt)
        self.srtt = rtt if math.isinf(self.srtt) else self.srtt + SRTT_GAIN * (rtt - self.srtt)
        send_phase = packet.sent_time - packet.first_sent_time
        ack_phase = now - packet.delivered_time
        interval = _quantize(max(send_phase, ack_phase))
        losses = self.lost - self._lost_at_last_ack
        self._lost_at_last_ack = self.lost
        sample = RateSample(
            packet=packet,
            rtt=rtt,
            delivered=self.delivered - packet.delivered,
            interval=interval,
            prior_delivered=packet.delivered,
            prior_in_flight=prior_in_flight,
            losses=losses,
            is_app_limited=packet.is_app_limited,
            arrived=self.arrived - packet.arrived,
            arrival_interval=(0.0 if packet.arrived_time is None or self.arrived_time is None
                              else _quantize(self.arrived_time - packet.arrived_time)),
        )
        if sample.valid and (not sample.is_app_limited or sample.delivery_rate > self.latest_rate):
            self.latest_rate = sample.delivery_rate
        return sample

    def on_delivered(self, now: float, nbytes: int) -> None:
        """Count bytes that crossed the path outside any packet (demand replies).

        They share the bottleneck with the packets, so, as every byte does in tcp_rate.c, they
        count in the delivery-rate samples of the packets in flight. Left out, a path half
        full of demand shows the controller only the other half: its bandwidth estimate, and
        with it the pacing rate that the demand is charged against, sinks toward the prefetch
        share, which then shrinks further, until prefetch stops altogether.
        """
        if nbytes <= 0:
            return
        self.delivered += nbytes
        self.delivered_time = now
        if self._app_limited_until:
            # The app-limited period ends when the packets in flight at the mark are delivered;
            # these bytes were none of them.
            self._app_limited_until += nbytes

    def on_arrived(self, now: float, nbytes: int) -> None:
        """Count bytes that reached the receiver off the path, in any order, up to ``now``
        (0 when a look found nothing new: the count is current as of then): the transport's
        own view (TCP's segment counters), which a held-back, then released, reply cannot
        inflate the way it does the delivery rate (see ``BBR._update_bw``). An arrival rate
        is timed from count to count, not from send to ack: a count taken a poll before the
        send would otherwise add a poll's arrivals to the round trip's."""
        self.arrived += max(nbytes, 0)
        self.arrived_time = now

    def on_lost(self, packet_id: int) -> SentPacket:
        packet = self._pop(packet_id)
        self.lost += packet.nbytes
        self.lost_packets += 1
        return packet

    def _pop(self, packet_id: int) -> SentPacket:
        try:
            packet = self._in_flight.pop(packet_id)
        except KeyError:
            raise KeyError(f"packet {packet_id} is not in flight") from None
        self.bytes_in_flight -= packet.nbytes
        return packet


class SampledController:
    """Shared plumbing for controllers built on a DeliveryRateSampler."""

    name = ""

    def __init__(self, *, initial_rtt: float = DEFAULT_INITIAL_RTT, mss: int = DEFAULT_MSS) -> None:
        if initial_rtt <= 0:
            raise ValueError(f"initial_rtt must be positive, got {initial_rtt}")
        if mss <= 0:
            raise ValueError(f"mss must be positive, got {mss}")
        self.mss = mss
        self.initial_rtt = initial_rtt
        self.sampler = DeliveryRateSampler()
        self._cwnd = INITIAL_WINDOW_SEGMENTS * mss
        self._pacing_rate = 0.0

    @property
    def min_cwnd(self) -> int:
        return MIN_WINDOW_SEGMENTS * self.mss

    @property
    def cwnd(self) -> int:
        return self._cwnd

    @property
    def pacing_rate(self) -> float:
        return self._pacing_rate

    @property
    def bytes_in_flight(self) -> int:
        return self.sampler.bytes_in_flight

    def can_send(self, nbytes: int) -> bool:
        """Whether a request of `nbytes` may start now.

        As Linux's tcp_cwnd_test: a request may start while bytes in flight are below cwnd, so
        in flight exceeds cwnd by less than one request. Requests are atomic; demanding that
        each fit whole would let one larger than the spare window (a 4 MiB read on a path whose
        BDP is 1.5 MB) go only after the pipe had drained. The pacer bounds the burst.
        """
        return self.sampler.bytes_in_flight < self._cwnd

    def on_app_limited(self, now: float) -> None:
        """The application had nothing to send although cwnd allowed it."""
        self.sampler.mark_app_limited()

    def on_bytes_delivered(self, now: float, nbytes: int) -> None:
        """Demand reply bytes arrived: they count in the delivery rate, not in the window."""
        self.sampler.on_delivered(now, nbytes)

    def on_path_loss(self, now: float, nbytes: int) -> None:
        """Loss repaired below the packets: BBR's STARTUP exit uses it, CUBIC reads it as a
        congestion event (BBR v1 reacts to its own packets' loss only)."""

    def on_path_arrivals(self, now: float, nbytes: int) -> None:
        """Bytes the receiver got off the path: they bound BBR's bandwidth samples."""
        self.sampler.on_arrived(now, nbytes)

    def _stats(self, *, state: str, starting: bool, btl_bw: float, min_rtt: float
               ) -> CongestionStats:
        s = self.sampler
        return CongestionStats(
            name=self.name,
            state=state,
            starting=starting,
            btl_bw=btl_bw,
            min_rtt=min_rtt,
            srtt=s.srtt,
            pacing_rate=self._pacing_rate,
            cwnd=self._cwnd,
            bytes_in_flight=s.bytes_in_flight,
            delivered_bytes=s.delivered,
            lost_bytes=s.lost,
            lost_packets=s.lost_packets,
        )
