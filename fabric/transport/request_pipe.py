"""The spoke's request pipe, sans-IO: which read request goes out next, and when.

The congestion controller (``fabric.congestion``) sees each read request as one "packet",
counted by the bytes of its response, sent when the request leaves and acked when the whole
response is in. Two classes share the one controller:

* **demand** - a reader is blocked on it. It leaves at once: never queued, never held back by
  cwnd or the pacer. It is charged to the pacer, so the prefetch requests after it wait by
  exactly its bytes and the total stays at the controller's rate. It is not one of the
  controller's packets: a 4 KiB request's round trip has no serialization in it, so it would
  drag min_rtt (and with it the BDP estimate and cwnd) below what the prefetch chunks need,
  and its delivery rate says nothing about the path. Its reply bytes do count as delivered
  (``on_demand_delivered``) in the rate samples of the prefetch chunks in flight: the pacer
  spends the controller's rate on demand and prefetch together, so the estimate must
  measure both, or a path carrying much demand is seen as only its prefetch share, the
  pacer gives prefetch less, the next samples are lower still, and prefetch stops. Demand
  volume is bounded by the readers themselves (each waits for its data), so it cannot flood
  the path the way a queue could.
* **prefetch** - queued FIFO and cut into chunks only as they leave (so each chunk is sized
  for the path as measured at that moment; jobs smaller than a chunk share one, as several
  ranges of one request); a chunk leaves only while bytes in flight are
  below cwnd and when the pacer allows. The pacer runs a little below the controller's
  pacing rate (``headroom``): BBR's bandwidth estimate is a max filter over delivery-rate
  samples, and ours are timed by a Python event loop a millisecond or so late at random, so
  the maximum sits above what the path carries by about that jitter over the round trip
  (+2-6 % at 60 ms, measured). Paced at 100 % of it, prefetch would build a queue at the
  bottleneck that BBR's 0.75 phase cannot drain, bounded only by cwnd (~1 BDP), and every
  demand reply would wait behind it.

The caller asks ``poll(now)`` and gets a chunk to send now, the time to ask again (pacer), or
None (window full or nothing queued: ask again after an ack or a submit). Nothing here reads
a clock or touches a socket. Times handed to the controller are counted from the first
``now`` the pipe sees: the controllers start their timers at 0 (BBR's min_rtt stamp), so a
clock that does not start near 0 (trio's has a random offset) would look like an expired
min_rtt window at the first ack and throw BBR into PROBE_RTT.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from neuralcache.blocks import BLOCK_SIZE

from ..congestion import CongestionController, CongestionStats, Pacer, ResumableController
from ..protocol import MAX_READ_BLOCKS, MAX_READ_RANGES
from .resend_rate import LOSSY_RESENT_RATIO

MIN_REQUEST_BYTES = 64 * 1024
"""Smallest prefetch chunk: the controller's segment (``DEFAULT_MSS``), 16 blocks."""

MAX_REQUEST_BYTES = MAX_READ_BLOCKS * BLOCK_SIZE
"""Largest chunk: what one ReadRequest may carry (4 MiB)."""

MAX_REQUEST_RATE = 125.0
"""Prefetch requests per second the spoke aims not to exceed on a path that does not lose
segments: each costs 100-300 us of Python on each side, so at high rates (loopback, >= 1 GB/s)
chunks grow to keep the count down (``python -m bench.transport --quick --links 0 1 --clients
bbr``, two runs each, alternating: loopback 0.44 and 0.58 GB/s after start-up at 500 requests
per second, 0.60 and 0.59 at 125; the 60 ms rows did not move beyond their noise)."""
LOSSY_REQUEST_RATE = 500.0
"""The same while the path loses segments: chunks stay small (see ``chunk_bytes``), four times
as many requests."""

ACK_TIMING_NOISE = 0.003
"""Seconds by which the spoke may time an arrival late (event-loop latency, the 2 ms arrival
poll): the headroom is this over min_rtt, so the bandwidth estimate's upward error, which
is about that ratio, is paced away."""

MIN_HEADROOM = 0.01
"""Headroom on long paths, where the timing noise is negligible: leaves BBR's 0.75 phase
something to drain."""

MAX_LOSS_HEADROOM = 0.02
"""Most of the resent share (``headroom``) added to ``MIN_HEADROOM``: random loss up to BBR's
``STARTUP_LOSS_RATE``. A start-up's overflow puts the share far above it for a window (17 % 2 s
into a clean 60 ms path's run); that is the queue draining, not room to leave for good."""

MAX_HEADROOM = 0.10
"""Headroom cap for sub-millisecond paths (loopback), where CPU, not the pacer, is the limit."""


def headroom(min_rtt: float, resent_share: float = 0.0) -> float:
    """Fraction of the controller's pacing rate prefetch leaves unused on a path of min_rtt
    whose hub lately resent ``resent_share`` of the bytes (``ResendRate``).

    Resent segments cross the bottleneck too, and the bandwidth estimate sits at what arrives,
    them included: its samples, inflated when TCP releases held-back replies together, are
    capped by the arrival rate, which counts them. At 900 ms / 1 % that estimate is the wire's
    payload rate (12.1 MB/s), so prefetch paced 1 % below it left the 1 % the resends take and
    next to nothing to drain a queue with; a probe's or start-up's queue stood for tens of
    seconds in front of the demand replies (docs/transport.md, "The 900 ms first contact's
    demand tail"). So the floor grows by the share. On short paths the timing noise (5 % at
    60 ms) already holds it: the larger of the two, not their sum."""
    floor = MIN_HEADROOM + min(max(resent_share, 0.0), MAX_LOSS_HEADROOM)
    if not math.isfinite(min_rtt) or min_rtt <= 0:
        return floor
    return min(MAX_HEADROOM, max(floor, ACK_TIMING_NOISE / min_rtt))


def chunk_bytes(pacing_rate: float, lossy: bool = False) -> int:
    """Size of the next prefetch chunk, in whole blocks: as small as the per-request cost
    allows, the more so on a ``lossy`` path. Small, because a chunk counts as delivered only
    once all its bytes have arrived, and at 1 % segment loss a 350 KB chunk (241 segments)
    almost always waits a round trip for a retransmission while a 64 KiB one does so a third
    of the time: the window must cover that wait, and the controller's RTT samples include
    it. Without loss a chunk's size only sets how many requests the two ends handle."""
    rate = LOSSY_REQUEST_RATE if lossy else MAX_REQUEST_RATE
    size = min(max(pacing_rate / rate, MIN_REQUEST_BYTES), MAX_REQUEST_BYTES)
    return int(size) // BLOCK_SIZE * BLOCK_SIZE


Piece = tuple[Hashable, int, int]
"""``(job, first block, count)``: one range of one queued job."""


@dataclass(frozen=True)
class Chunk:
    """One prefetch request ready to go: one or more ranges (``pieces``) of queued jobs, in
    queue order. Several small jobs (a shuffled loader's 16 KiB samples) share a chunk, so a
    chunk costs one request whatever the jobs' size (``MAX_READ_RANGES`` at most)."""

    packet_id: int
    pieces: tuple[Piece, ...]

    @property
    def count(self) -> int:
        return sum(piece[2] for piece in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.count * BLOCK_SIZE


class RequestPipe:
    """Admission of read requests under one congestion controller and pacer."""

    def __init__(self, controller: CongestionController, *, pacer: Pacer | None = None) -> None:
        self.controller = controller
        self._resent_share = 0.0  # as of the last poll (``headroom``)
        self.pacer = pacer if pacer is not None else Pacer(self.rate)
        self._origin: float | None = None
        self._queue: deque[list] = deque()  # [job, next block, end block], FIFO
        self._queued_blocks = 0
        self._jobs: dict[Hashable, int] = {}  # job -> entries of it in the queue
        self._ids = itertools.count(1)

    @property
    def rate(self) -> float:
        """Bytes per second the pacer releases requests at: the controller's rate less the
        headroom."""
        return self.controller.pacing_rate * (1.0 - self.headroom)

    @property
    def headroom(self) -> float:
        """Fraction of the controller's pacing rate left unused (see ``headroom()``)."""
        return headroom(self.controller.stats().min_rtt, self._resent_share)

    @property
    def queued_bytes(self) -> int:
        """Prefetch bytes waiting to be requested."""
        return self._queued_blocks * BLOCK_SIZE

    def stats(self) -> CongestionStats:
        return self.controller.stats()

    # -- prefetch queue --------------------------------------------------------------------

    def submit(self, job: Hashable, first: int, count: int) -> None:
        """Queue blocks ``first .. first + count - 1`` for ``job`` behind earlier prefetch."""
        if count > 0:
            self._queue.append([job, first, first + count])
            self._queued_blocks += count
            self._jobs[job] = self._jobs.get(job, 0) + 1

    def requeue(self, job: Hashable, first: int, count: int) -> None:
        """Put a lost or corrupted chunk back at the head: it was asked for first."""
        if count > 0:
            self._queue.appendleft([job, first, first + count])
            self._queued_blocks += count
            self._jobs[job] = self._jobs.get(job, 0) + 1

    def take(self, wanted: Callable[[Hashable], bool], first: int, end: int
             ) -> list[tuple[Hashable, int, int]]:
        """Remove blocks ``[first, end)`` of the queued jobs that ``wanted`` picks from the
        queue, and return them as ``(job, first, count)`` pieces: a reader is now waiting for
        them, so they go out as demand instead of waiting their turn (``HubClient.expedite``).
        Blocks of those jobs already sent are not the pipe's any more, and are left alone."""
        taken: list[tuple[Hashable, int, int]] = []
        kept: deque[list] = deque()
        for entry in self._queue:
            job, lo, hi = entry
            a, b = max(lo, first), min(hi, end)
            if a >= b or not wanted(job):
                kept.append(entry)
                continue
            taken.append((job, a, b - a))
            self._queued_blocks -= b - a
            parts = [part for part in ([job, lo, a], [job, b, hi]) if part[1] < part[2]]
            kept.extend(parts)
            self._jobs[job] += len(parts) - 1
            if not self._jobs[job]:
                del self._jobs[job]
        self._queue = kept
        return taken

    def cancel(self, job: Hashable) -> None:
        """Drop whatever of ``job`` is still queued (its reader gave up)."""
        if self._jobs.pop(job, None) is None:
            return
        kept = deque(e for e in self._queue if e[0] is not job)
        self._queued_blocks = sum(e[2] - e[1] for e in kept)
        self._queue = kept

    def _since(self, now: float) -> float:
        """``now`` on the controller's clock, which starts at the first time the pipe is used."""
        if self._origin is None:
            self._origin = now
        return now - self._origin

    def poll(self, now: float, resent_share: float = 0.0) -> Chunk | float | None:
        """The chunk to send now (already counted as sent), the time to poll again, or None.
        ``resent_share``: of the bytes the path lately delivered, the share the hub's TCP
        resent (``ResendRate.ratio``), for the chunks' size and the headroom."""
        t = self._since(now)
        self._resent_share = resent_share
        if not self._queue:
            if self.controller.can_send(MIN_REQUEST_BYTES):
                self.controller.on_app_limited(t)  # room in the window, nothing to ask
            return None
        if not self.controller.can_send(MIN_REQUEST_BYTES):
            return None
        lossy = resent_share >= LOSSY_RESENT_RATIO
        pieces = self._head(chunk_bytes(self.controller.pacing_rate, lossy) // BLOCK_SIZE)
        nbytes = sum(piece[2] for piece in pieces) * BLOCK_SIZE
        self.pacer.update_rate(self.rate, t)
        when = self.pacer.next_send_time(t, nbytes)
        if when > t:
            return now + (when - t)
        for job, first, count in pieces:
            entry = self._queue[0]
            entry[1] = first + count
            if entry[1] >= entry[2]:
                self._queue.popleft()
                self._forget(job)
            self._queued_blocks -= count
        chunk = Chunk(next(self._ids), tuple(pieces))
        self.controller.on_packet_sent(t, chunk.packet_id, nbytes)
        self.pacer.on_sent(t, nbytes)
        return chunk

    def _head(self, blocks: int) -> list[Piece]:
        """The pieces the next chunk of up to ``blocks`` blocks takes from the head of the
        queue, in order (at most ``MAX_READ_RANGES``; the last may be part of its entry)."""
        pieces: list[Piece] = []
        for job, first, end in self._queue:
            count = min(blocks, end - first)
            pieces.append((job, first, count))
            blocks -= count
            if not blocks or len(pieces) == MAX_READ_RANGES:
                break
        return pieces

    def _forget(self, job: Hashable) -> None:
        left = self._jobs[job] - 1
        if left:
            self._jobs[job] = left
        else:
            del self._jobs[job]

    # -- demand and completions ------------------------------------------------------------

    def path_bandwidth(self) -> float | None:
        """The controller's BtlBw worth keeping for a later ``resume``, if it keeps one."""
        if isinstance(self.controller, ResumableController):
            return self.controller.path_bandwidth()
        return None

    def resume(self, now: float, btl_bw: float, rtt: float) -> bool:
        """Start the controller from a kept model (``ResumableController.resume``); False if it
        cannot resume or has already begun."""
        if isinstance(self.controller, ResumableController):
            return self.controller.resume(self._since(now), btl_bw, rtt)
        return False

    def on_path_loss(self, now: float, nbytes: int) -> None:
        """The hub reports that its TCP resent ``nbytes`` (protocol version >= 3)."""
        self.controller.on_path_loss(self._since(now), nbytes)

    def on_path_arrivals(self, now: float, nbytes: int) -> None:
        """``nbytes`` more reached the spoke's kernel, in any order (TCP's segment counts)."""
        self.controller.on_path_arrivals(self._since(now), nbytes)

    def send_demand(self, now: float, nbytes: int) -> None:
        """Charge a demand request of ``nbytes``, sent now, to the pacer."""
        t = self._since(now)
        self.pacer.update_rate(self.rate, t)
        self.pacer.on_sent(t, nbytes)

    def on_demand_delivered(self, now: float, nbytes: int) -> None:
        """The reply to a demand request (``nbytes`` of it) has arrived."""
        self.controller.on_bytes_delivered(self._since(now), nbytes)

    def on_acked(self, now: float, packet_id: int) -> None:
        self.controller.on_packet_acked(self._since(now), packet_id)

    def on_lost(self, now: float, packet_id: int) -> None:
        self.controller.on_packet_lost(self._since(now), packet_id)
