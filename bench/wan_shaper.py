"""Sans-IO model of one direction of an emulated WAN link.

The forwarder (``bench.wan_forwarder``) owns the file descriptors and the clock;
this module only decides *what happens to a packet and when*, so its behaviour
can be tested with a fake clock and no TUN devices.

A packet offered to a direction goes through, in order:

1. random loss (probability ``loss``, from a seedable RNG),
2. a FIFO tail-drop queue bounded in bytes,
3. serialization at ``rate_bps`` (a packet of ``n`` bytes occupies the link
   for ``8 * n / rate_bps`` seconds),
4. a constant one-way propagation delay.

The queue is not stored separately: because the link is FIFO with a constant
rate, the bytes still waiting to be serialized at time ``now`` are exactly
``(busy_until - now) * rate / 8``. Every accepted packet gets its arrival time
at the far end fixed on enqueue, and since both serialization end times and the
delay are monotonic, a single deque ordered by arrival time is the whole state.
A frame that carries a burst of segments (``bench.wan_gso``) is offered segment
by segment (``admit``) and leaves with its last admitted one.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import asdict, dataclass, field

BITS_PER_BYTE = 8
QUEUE_SLACK_BYTES = 0.5  # backlog computed from float times may be off by a hair; below
# half a byte it is rounding, not a queued packet, and must not cause a tail drop
QUEUE_WAIT_BOUNDS_MS = (1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 200, 300, 450, 600, 900, 1200)
"""Upper bounds (ms) of the queue-wait histogram's buckets, a last one catching the rest:
fine enough to tell a fraction of a 60 ms round trip from a whole one, and to reach a full
one-BDP queue on a 900 ms path. What a packet waited behind the bottleneck is the part of a
reply's latency the sender's pacing decides."""


@dataclass
class DirectionCounters:
    """What happened to the packets offered to one direction.

    ``forwarded`` counts packets handed out by :meth:`LinkDirection.due`
    (i.e. delivered to the far end), so packets still in flight are in none of
    the three groups until they arrive. A packet is a segment on the wire, with
    its headers: a frame carrying a burst counts as the segments it carries.
    """

    forwarded_packets: int = 0
    forwarded_bytes: int = 0
    lost_packets: int = 0
    lost_bytes: int = 0
    queue_dropped_packets: int = 0
    queue_dropped_bytes: int = 0
    queue_wait_ms: list[int] = field(  # accepted packets per QUEUE_WAIT_BOUNDS_MS bucket
        default_factory=lambda: [0] * (len(QUEUE_WAIT_BOUNDS_MS) + 1))

    def as_dict(self) -> dict[str, int | list[int]]:
        return asdict(self)


def queue_wait_quantile(counts: list[int], q: float) -> float:
    """The upper bound (ms) of the bucket holding quantile ``q`` of a ``queue_wait_ms``
    histogram (inf for the last bucket, nan when empty): an upper bound on that quantile."""
    total = sum(counts)
    if not total:
        return float("nan")
    rank, seen = q * total, 0
    for bound, count in zip((*QUEUE_WAIT_BOUNDS_MS, float("inf")), counts):
        seen += count
        if seen >= rank:
            return float(bound)
    return float("inf")


class LinkDirection:
    """One direction of the link: loss, tail-drop queue, rate, delay."""

    def __init__(
        self,
        rate_bps: float,
        delay: float,
        queue_bytes: int,
        loss: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if rate_bps <= 0:
            raise ValueError(f"rate must be positive, got {rate_bps}")
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        if queue_bytes <= 0:
            raise ValueError(f"queue bound must be positive, got {queue_bytes}")
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        self.rate_bps = rate_bps
        self.delay = delay
        self.queue_bytes = queue_bytes
        self.loss = loss
        self._rng = rng if rng is not None else random.Random()
        self._busy_until = float("-inf")  # when the serializer finishes its backlog
        # (arrival time, frame, segments, bytes on the wire), in arrival order
        self._in_flight: deque[tuple[float, bytes, int, int]] = deque()
        self.counters = DirectionCounters()

    def backlog_bytes(self, now: float) -> float:
        """Bytes accepted but not yet serialized onto the wire at ``now``."""
        return max(0.0, self._busy_until - now) * self.rate_bps / BITS_PER_BYTE

    def enqueue(self, now: float, packet: bytes) -> bool:
        """Offer ``packet`` at time ``now``; False if it was lost or tail-dropped."""
        arrival = self.admit(now, [len(packet)])[0]
        if arrival is None:
            return False
        self.schedule(arrival, packet, 1, len(packet))
        return True

    def admit(self, now: float, sizes: list[int]) -> list[float | None]:
        """Offer segments of ``sizes`` bytes, back to back, at ``now``: for each, the time it
        reaches the far end, or None if it was lost or tail-dropped. A burst the sender's
        kernel handed over in one piece (``bench.wan_gso``) still meets loss, the queue bound
        and the serialiser segment by segment. The caller ``schedule``s what was admitted."""
        counters, rate, bound = self.counters, self.rate_bps, self.queue_bytes + QUEUE_SLACK_BYTES
        waits = counters.queue_wait_ms
        out: list[float | None] = []
        for size in sizes:
            if self.loss and self._rng.random() < self.loss:
                counters.lost_packets += 1
                counters.lost_bytes += size
                out.append(None)
                continue
            if self.backlog_bytes(now) + size > bound:
                counters.queue_dropped_packets += 1
                counters.queue_dropped_bytes += size
                out.append(None)
                continue
            start = max(now, self._busy_until)
            waits[bisect.bisect_left(QUEUE_WAIT_BOUNDS_MS, (start - now) * 1000)] += 1
            self._busy_until = start + size * BITS_PER_BYTE / rate
            out.append(self._busy_until + self.delay)
        return out

    def schedule(self, arrival: float, frame: bytes, segments: int, wire_bytes: int) -> None:
        """Hand ``frame`` (``segments`` admitted segments, ``wire_bytes`` on the wire) out at
        ``arrival``, the time ``admit`` gave its last segment. Frames must be scheduled in the
        order their segments were admitted."""
        self._in_flight.append((arrival, frame, segments, wire_bytes))

    def due(self, now: float) -> list[bytes]:
        """Remove and return, in order, every frame that has arrived by ``now``."""
        out: list[bytes] = []
        flight = self._in_flight
        counters = self.counters
        while flight and flight[0][0] <= now:
            _, frame, segments, wire_bytes = flight.popleft()
            out.append(frame)
            counters.forwarded_packets += segments
            counters.forwarded_bytes += wire_bytes
        return out

    def next_wakeup(self) -> float | None:
        """Arrival time of the next packet, or None when nothing is in flight."""
        return self._in_flight[0][0] if self._in_flight else None

    @property
    def in_flight_packets(self) -> int:
        """Segments accepted (queued or on the wire) and not yet delivered."""
        return sum(entry[2] for entry in self._in_flight)
