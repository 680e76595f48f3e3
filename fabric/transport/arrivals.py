"""When did a reply reach the spoke's kernel? Sans-IO, from the kernel's TCP counters.

TCP hands data to the application in order. After one lost segment everything behind it on
that connection waits in the kernel's out-of-order queue until the retransmission lands, a
round trip or more later, and is then released at once. Acked at that release, the
congestion controller would see replies that took two round trips and then a burst of
"deliveries" far above the link rate; with several connections the other connections' acks
keep its delivery clock running during the stall, so the burst inflates BBR's max-filtered
bandwidth estimate (by ~25 % at 1 % loss, measured) and its pacing overfills the
bottleneck. The kernel's own BBR does not have this problem because SACK tells it what
arrived, in any order. This module gives our controller the same view: a reply counts as
delivered when its bytes have reached the spoke's TCP, holes or not.

The counters (``TCP_INFO``): ``bytes_received`` (in-order bytes, exact), ``data_segs_in``
(data segments received, in order or not), ``rcv_ooopack`` (those that arrived out of order)
and ``rcv_mss``. Arrived = in-order bytes + bytes held out of order, and the held bytes are
followed from one look to the next: every new segment adds ``rcv_mss x SEGMENT_FILL``, every
new in-order byte takes one away (it either arrived in order or left the out-of-order
queue); the held bytes never grow by more than the new out-of-order segments can carry and
never go below zero. The estimate errs low (the fill is a little under a full segment) and
is pulled back to the exact in-order count whenever the out-of-order queue empties: the bytes
declared arrived do not exceed those that did (a hypothesis test checks it over random loss
patterns), and a reply is declared arrived at the latest when the application gets it, as
without this module.

Arrived bytes are attributed to replies in stream order, the order they were requested in
(the hub answers roughly in order): this is byte counting, like SACK's, not per-reply
knowledge. A reply with a hole of its own may be declared arrived on the strength of bytes
that arrived after it; that moves an ack from one reply to a neighbour, not the count of
bytes delivered, which is what the controller's rate samples are made of. Replies are
assumed to be prefetch chunks of at least 64 KiB, whose segments are full but for the last;
sizes are the expected frame sizes, corrected to the exact stream position every time the
application completes a frame.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

SEGMENT_FILL = 0.99
"""Payload per out-of-order segment, as a fraction of the MSS: a 64 KiB-4 MiB reply's segments
are full but for its last. Every byte that passes through the out-of-order queue is counted
in at this and out at 1, so the estimate drifts low by (1 - fill) of that traffic until the
queue empties; it must be close to the truth (at 0.97 the estimate kept only ~40 % of the
held bytes at 1 % loss, measured)."""


@dataclass(frozen=True)
class TcpCounters:
    """The receive-side ``TCP_INFO`` fields this module reads."""

    bytes_received: int  # in order, since the connection opened
    data_segs_in: int  # data segments received, in order or not
    ooo_packets: int  # segments that arrived out of order, ever
    rcv_mss: int  # the sender's segment size, as the receiver estimates it


class ArrivalCount:
    """Bytes that reached the kernel on one connection, in any order, as the controller's
    arrival cap counts them (``BBR._update_bw``): each new data segment at the full segment
    size, a slight over-count.

    Unless the receiver coalesces: one that takes bursts whole (a virtio-net guest offered the
    host's receive offload; the WAN emulator's TUN devices, ``bench.wan_gso``) counts a burst
    of tens of segments as one, and counted by segments its bytes came to a fraction of what
    arrived (the cap then held BBR's estimate at a tenth of the link). So the count never falls
    behind the in-order bytes, which are exact whatever the receiver: what they show beyond the
    segment count is counted too. On a receiver that counts every segment the segments are
    always ahead (each carries at most a full segment, and bytes released from the
    out-of-order queue were counted when their segments came), and this is the segment count
    alone."""

    def __init__(self) -> None:
        self._segments = 0  # data segments at the last look
        self._counted = 0  # bytes counted so far

    def update(self, c: TcpCounters) -> int:
        """Bytes that arrived since the last look."""
        new = (c.data_segs_in - self._segments) * c.rcv_mss
        self._segments = c.data_segs_in
        self._counted += new
        if c.bytes_received > self._counted:
            new += c.bytes_received - self._counted
            self._counted = c.bytes_received
        return new


class ArrivalTracker:
    """Replies outstanding on one connection, and which of them have arrived at the kernel."""

    def __init__(self, *, segment_fill: float = SEGMENT_FILL) -> None:
        self._fill = segment_fill
        self._pending: dict[Hashable, int] = {}  # key -> expected frame bytes, in stream order
        self._arrived: set[Hashable] = set()
        self._consumed = 0  # stream bytes of every frame the application has completed
        self._held = 0.0  # estimated bytes in the kernel's out-of-order queue
        self._last: TcpCounters | None = None

    def expect(self, key: Hashable, frame_bytes: int) -> None:
        """A request went out whose reply (about ``frame_bytes`` on the wire) comes next."""
        self._pending[key] = frame_bytes

    def completed(self, key: Hashable, consumed: int) -> None:
        """The application has the whole reply to ``key``; ``consumed`` is the exact stream
        position after it."""
        self._consumed = consumed
        self._pending.pop(key, None)
        self._arrived.discard(key)
        if not self._pending:
            # Nothing outstanding, so nothing can be held: whatever the estimate had drifted to
            # (a duplicate segment counts as one that arrived) is dropped here.
            self._held = 0.0

    def arrived_bytes(self, c: TcpCounters) -> int:
        """Stream bytes that have reached the kernel, in any order (a slight under-count)."""
        last = self._last
        self._last = c
        if last is None:
            return c.bytes_received
        new_segs = c.data_segs_in - last.data_segs_in
        new_ooo = c.ooo_packets - last.ooo_packets
        # Held bytes grow by at most what new out-of-order segments can carry (a partial
        # segment arriving in order must not count) and shrink by what became in-order.
        self._held = max(0.0, min(
            self._held + new_segs * c.rcv_mss * self._fill
            - (c.bytes_received - last.bytes_received),
            self._held + new_ooo * c.rcv_mss))
        return c.bytes_received + int(self._held)

    def observe(self, c: TcpCounters) -> list[Hashable]:
        """Replies whose bytes have all arrived since the last call, in stream order."""
        arrived = self.arrived_bytes(c)
        end = self._consumed
        out = []
        for key, size in self._pending.items():
            end += size
            if end > arrived:
                break
            if key not in self._arrived:
                self._arrived.add(key)
                out.append(key)
        return out
