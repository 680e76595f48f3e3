"""The cap a spoke asks the hub to put on the pacing of its bulk connections' replies, sans-IO.

The spoke's controller paces the requests, and so the replies; but the hub's kernel sends each
reply at the pace of that connection's own TCP congestion control. The kernel's BBR on a bulk
connection sees only the share of the path our pacing gives it, so its samples are all
application-limited, it never sees its bandwidth stop growing, and it stays in its start-up,
pacing at 2.89 times what it measured: `ss -tin` in the hub's namespace showed bulk
connections still in start-up 45 s into a run, pacing at up to 573 Mbit/s on a 200 Mbit/s link
(docs/transport.md, "The pacing cap"). Their replies then leave in bursts above the
bottleneck's rate and queue there, in front of the demand replies.

``SO_MAX_PACING_RATE`` caps that pacing, so the spoke sends each bulk connection the highest
rate its controller paced at over the last BBR gain cycle (at least ``MIN_WINDOW``; the cycle
is eight round trips), times ``MARGIN``. Kept over the cycle, the cap does not dip and rise
with each phase, and it lets through the 1.25 probing phase; it follows start-up as it grows.
It is rounded up to a power of ``STEP`` so that small changes send nothing.

On a path of ``SHARE_MIN_RTT`` or more, each connection gets ``SHARE`` times its even share of
that cap (at most all of it), not the whole: a connection that kept a backlog (behind a
retransmission timeout, or the kernel BBR's PROBE_RTT where the hub runs ``bbr``) cannot
release it at the whole path's rate on top of everyone else's replies, which overflowed the
bottleneck's queue (docs/transport.md, "The hub kernel's PROBE_RTT, and a share of the cap per
connection"). With ``nc_paced`` on the hub the cap is the rate each connection's replies leave
at (``kernel_cc``), and an even share kept the queue shortest ("nc_paced: a kernel congestion
control that follows our pacing")."""

from __future__ import annotations

import math
from collections import deque

from .tcp import UNLIMITED_PACING

MIN_WINDOW = 1.0
"""Seconds the highest recent pacing rate is kept at least, on short paths."""

CYCLE_ROUND_TRIPS = 10
"""Round trips it is kept on long ones: BBR's eight-phase gain cycle, and two to spare."""

MARGIN = 1.1
"""The cap over that rate: the kernel paces wire bytes (headers, resent segments), the
controller payload."""

SHARE = 1.0
"""Each of N bulk connections is capped at ``SHARE / N`` of the spoke's cap (at most 1). Under
the kernel's BBR, 2 (room for the others to carry a connection stalled in PROBE_RTT) did better
than the whole cap; under ``nc_paced``, which has no such stall, 1 did better than 2 (shorter
queues, fewer drops, a lower demand tail at 900 ms)."""

SHARE_MIN_RTT = 0.2
"""Round trip (s) below which each connection gets the whole cap. On a long path a stall is
long (a timeout, or the kernel BBR's PROBE_RTT: two round trips, 1.8 s at 900 ms) and so is the
backlog it releases; there shares cut the bottleneck's overflows (docs/transport.md, "The hub
kernel's PROBE_RTT, and a share of the cap per connection"). At 60 ms they cost a mount's cold
start a point or two under the kernel's BBR, and on loopback throughput; paths in between were
not measured."""

STEP = 2 ** (1 / 8)
"""Caps are powers of this (~9 % apart), so the cap changes only when the rate moves by a step."""


class ReplyPacing:
    """The cap to ask for, from the controller's pacing rate at each request sent.

    Not ``congestion.WindowedFilter``: its window is fixed and its maximum approximate (three
    samples), where this one's window follows min_rtt and its maximum is exact, so that the
    cap never falls below a rate the controller paced at within the cycle."""

    def __init__(self) -> None:
        self._recent: deque[tuple[float, float]] = deque()  # (time, rate), rates decreasing

    def limit(self, now: float, pacing_rate: float, min_rtt: float, connections: int = 1) -> int:
        """Bytes/s the hub should pace the replies of each of this spoke's ``connections``
        bulk connections at most; ``min_rtt`` may be inf before the first sample. No cap
        (``UNLIMITED_PACING``) while the controller has no rate to give: a cap of nothing would
        stop the replies its next rate depends on."""
        while self._recent and self._recent[-1][1] <= pacing_rate:
            self._recent.pop()
        self._recent.append((now, pacing_rate))
        window = max(MIN_WINDOW, CYCLE_ROUND_TRIPS * min_rtt) if math.isfinite(min_rtt) \
            else MIN_WINDOW
        while self._recent[0][0] < now - window:
            self._recent.popleft()
        highest = self._recent[0][1] * MARGIN
        if math.isfinite(min_rtt) and min_rtt >= SHARE_MIN_RTT:
            highest *= min(1.0, SHARE / max(1, connections))
        if not (math.isfinite(highest) and highest >= 1):
            return UNLIMITED_PACING
        return math.ceil(STEP ** math.ceil(math.log(highest, STEP)))
