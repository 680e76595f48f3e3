"""BBR v1 (Linux's tcp_bbr.c) over request-sized "packets", in bytes and float seconds.

Model: BtlBw = windowed max of delivery-rate samples over 10 packet-timed round trips;
min_rtt = minimum RTT, refreshed at least every 10 s (PROBE_RTT forces a refresh).
pacing_rate = pacing_gain * BtlBw * 0.99; cwnd = cwnd_gain * BtlBw * min_rtt + 3 segments.

Left out relative to the kernel (see docs/congestion.md): the long-term policer detector
(lt_bw), ACK-aggregation cwnd boost (extra_acked) and the packet-conservation round of loss
recovery. Losses only take the lost bytes out of cwnd, which later acks grow back toward the
model's target - the kernel's arithmetic outside its first recovery round - so loss never
lowers the pacing rate or the bandwidth model. Added: PROBE_RTT is skipped when a recent RTT
sample came within 1/8 of min_rtt (as Chromium QUIC's BBR may), PROBE_RTT holds half a BDP
rather than 4 packets (BBR v2), the minimum window is 4 requests rather than 4 segments,
STARTUP also ends on loss that TCP repaired below the requests (BBR v2's loss threshold), and
while the transport below keeps reporting such loss, no bandwidth sample exceeds what reached
the receiver and the window has room for the replies TCP holds behind its holes; on a clean
path PROBE_BW's cwnd gain is 1.5, not 2 (our acks are not delayed the way TCP's are). A flow
may start from the model an earlier one had of the same path (``resume``, careful resume).
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque

from .base import (
    DEFAULT_INITIAL_RTT,
    DEFAULT_MSS,
    INITIAL_WINDOW_SEGMENTS,
    CongestionStats,
    RateSample,
    SampledController,
)
from .windowed_filter import WindowedFilter

HIGH_GAIN = 2 / math.log(2)
"""STARTUP pacing and cwnd gain (~2.885): the smallest that doubles delivery each round."""

DRAIN_GAIN = 1 / HIGH_GAIN
"""DRAIN pacing gain: empties the STARTUP queue in about one round."""

CWND_GAIN = 2.0
"""PROBE_BW cwnd gain while loss goes on (``SUSTAINED_LOSS_SPAN``), the kernel's: room for
delayed/stretched acks and for the 1.25 probing phase, and for replies TCP holds behind a
hole. At 1.5 the 900 ms / 1 % path lost 4-10 points of goodput after start-up."""

CLEAN_CWND_GAIN = 1.5
"""PROBE_BW cwnd gain on a path that is not losing. The kernel's 2 leaves room for acks that
come late and together; ours are not delayed that way (a request is acked as its reply's
bytes reach the spoke's kernel, polled every 2 ms), so the second BDP only let a queue build
at the bottleneck, in front of every demand reply: at 60 ms / 0 % the demand p99 was 1.43-1.57
RTT with 2 (five runs) and 1.37-1.41 with 1.5 (four), goodput unchanged (docs/congestion.md).
1.5 still holds the 1.25 probing phase's inflight."""

PACING_GAIN_CYCLE = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
"""PROBE_BW pacing gains, one phase per min_rtt: probe up, drain, then cruise six phases."""

CYCLE_RANDOM_PHASES = 7
"""The PROBE_BW cycle starts at a random phase other than the 0.75 one (kernel: bbr_cycle_rand)."""

BW_FILTER_ROUNDS = len(PACING_GAIN_CYCLE) + 2
"""BtlBw max-filter window, in round trips (10): one full gain cycle plus slack."""

MIN_RTT_WINDOW = 10.0
"""Seconds a min_rtt sample stays valid before PROBE_RTT re-measures it."""

PROBE_RTT_DURATION = 0.2
"""Seconds spent at the PROBE_RTT window (~2 % of MIN_RTT_WINDOW)."""

PROBE_RTT_CWND_GAIN = 0.5
"""PROBE_RTT holds cwnd at this share of the BDP (never below the minimum window), BBR v2's
``bbr_probe_rtt_cwnd_gain``: half a BDP in flight leaves the bottleneck queue empty, which is
all the probe needs, and keeps half the rate going. v1's 4 packets idle the path for the probe's
200 ms and a round trip, after waiting for inflight to fall to them: on the 900 ms / 1 % path,
with requests held behind TCP retransmission timeouts, 9 s at 0-17 % of the line rate in one
``bench.transport --save`` run."""

SIMILAR_MIN_RTT = 1.125
"""When the min_rtt window expires, PROBE_RTT is skipped (and the window restarted) if an RTT
sample of the last ``RECENT_RTT_WINDOW`` came within this factor of min_rtt: the path's delay
has not grown and our queue was seen to drain to within 1/8 of it, which is what PROBE_RTT
would re-measure. Chromium QUIC's BBR does the same (`kSimilarMinRttThreshold`, flag
`probe_rtt_skipped_if_similar_rtt`; it looks at every sample since the last refresh, which
can predate a route change by the whole window). Probing is not free on long paths: on the
900 ms one it holds four requests in flight for 200 ms plus a round trip, after waiting for
every request in flight, some held a round trip behind a TCP retransmission: 3-11 s per probe
in measured runs (``bench.transport --save``)."""

RECENT_RTT_WINDOW = MIN_RTT_WINDOW / 2
"""Seconds of RTT samples that may vouch for min_rtt at its expiry (``SIMILAR_MIN_RTT``): the
second half of the window, so a delay that grew at least that long ago is probed for. Long
enough to hold a PROBE_BW gain cycle (8 round trips) on a 600 ms path."""

MIN_WINDOW_REQUESTS = 4
"""Smallest cwnd in requests (tcp_bbr.c's ``bbr_cwnd_min_target`` is 4 packets; a request is
our packet): on loopback, where chunks are 2-3 MiB and min_rtt is one request's service time,
a window of 4 segments' bytes held under two chunks in flight and kept the hub idle between
them (0.63 GB/s where a controller that did not limit got 0.98)."""

FULL_BW_GROWTH = 1.25
"""STARTUP goes on while BtlBw grows by at least 25 % per round..."""

FULL_BW_ROUNDS = 3
"""...and ends after this many rounds without such growth."""

STARTUP_LOSS_RATE = 0.02
"""STARTUP also ends after a round in which the transport below resent more than this share of
the bytes delivered (BBR v2's ``bbr_loss_thresh``; v1 has no loss exit, but its packets see
the loss, where ours are requests whose loss TCP repairs out of sight). A prefetcher slower
than the link keeps the flow app-limited, which the growth test ignores, so STARTUP went on
pacing bursts at 2.9x into a one-BDP bottleneck buffer: 15,868 tail drops in a full-size cold
sequential `bench.repro` run. Random loss below this share does not end it."""

SUSTAINED_LOSS_SPAN = 10.0
"""Loss reported by the transport below (``on_path_loss``) in ``SUSTAINED_LOSS_SECONDS``
distinct seconds of the last this many is loss that goes on: it gives the window room for the
replies TCP holds behind its holes (``HELD_ALLOWANCE_MAX``)."""

SUSTAINED_LOSS_SECONDS = 5
"""Random loss on a busy path is reported every second; a queue overflowing once (BBR's
start-up on a clean path) is reported in one or two, and is over before held replies matter."""

HELD_ALLOWANCE_MAX = 0.1
"""While loss goes on (``SUSTAINED_LOSS_SPAN``), PROBE_BW's window has room for one more
BDP, but for no more than this many seconds at BtlBw: the replies TCP holds behind a hole,
about a round trip's worth on a busy connection (the request round trip is about twice
min_rtt at 60 ms / 1 %), count in flight until they are released or seen to arrive. Without
the room, two BDPs left the window full and a 60 ms / 1 % link at 88.1-89.5 % of line rate
after start-up (92-94 % before the cap, when the inflated estimate made the window larger).
The bound is the kernel's for its own window allowance for acks that come late and together
(``bbr_extra_acked_max_us``): on a 900 ms path a whole extra BDP only queued at the bottleneck
(demand p99 5-6 round trips against 3 in a 60 s run) and carried no more."""

RESUME_SHARE = 0.5
"""A resumed flow (``resume``) starts from this share of the bandwidth it remembers, as careful
resume does (draft-ietf-tsvwg-careful-resume jumps to half the saved window): the path may be
busier than when it was measured, and STARTUP's gain takes a share that the path does carry up
to the whole in one round."""

RESUME_ROUNDS = 3
"""Rounds the remembered share counts as an estimate without any sample confirming it. A path
slower than remembered is then seen by its own samples; in the max filter the remembered rate
would stay for ``BW_FILTER_ROUNDS`` (10) round trips, 9 s at 900 ms."""

RESUME_REACHED = 0.9
"""A resumed STARTUP ends once samples reach this share of the remembered bandwidth: the path
is known to carry that much, and three more rounds at 2.9x to find the plateau only fill the
bottleneck queue (at 900 ms they took 3-5 s, docs/transport.md "Start-up at 900 ms"; resumed
runs reached PROBE_BW 5-11 s before first contacts beside them, with a third of the drops)."""

PACING_MARGIN = 0.01
"""Pace 1 % below the estimate so the bottleneck queue drains on average."""

QUANTIZATION_SEGMENTS = 1
"""Segments added to the inflight targets that end DRAIN and the PROBE_BW phases (the kernel
budgets 3 TSO bursts): requests are atomic, so inflight tracks a target only to within one
request. Whatever is added here is left as standing queue, so keep it at one segment."""

PROBE_EXTRA_SEGMENTS = 2
"""Extra segments during the 1.25 phase so probing lifts inflight above BDP even at small BDPs."""


class BBRState(enum.Enum):
    STARTUP = "startup"
    DRAIN = "drain"
    PROBE_BW = "probe_bw"
    PROBE_RTT = "probe_rtt"


class BBR(SampledController):
    """Sans-IO BBR v1: feed it sends, acks and losses with `now`; read pacing_rate and cwnd."""

    name = "bbr"

    def __init__(
        self,
        *,
        initial_rtt: float = DEFAULT_INITIAL_RTT,
        mss: int = DEFAULT_MSS,
        seed: int | None = None,
    ) -> None:
        super().__init__(initial_rtt=initial_rtt, mss=mss)
        self._rng = random.Random(seed)
        self.state = BBRState.STARTUP
        self.pacing_gain = HIGH_GAIN
        self.cwnd_gain = HIGH_GAIN
        self._bw = WindowedFilter.max_filter(BW_FILTER_ROUNDS)
        self._request_size = WindowedFilter.max_filter(BW_FILTER_ROUNDS)
        self.round_count = 0
        self._next_round_delivered = 0
        self._round_start = False
        self.min_rtt = math.inf
        self._min_rtt_stamp = 0.0
        self._recent_rtt = WindowedFilter.min_filter(RECENT_RTT_WINDOW)
        self._has_seen_rtt = False
        self.full_bw_reached = False
        self._full_bw = 0.0
        self._full_bw_count = 0
        self._round_resent = 0  # bytes the transport resent during this round
        self._round_delivered_mark = 0  # sampler.delivered when this round started
        self._loss_seconds: deque[int] = deque()  # recent whole seconds with a loss report
        self._sustained_loss = False  # as of the latest ack
        self._cycle_index = 0
        self._cycle_stamp = 0.0
        self._prior_cwnd = 0
        self._probe_rtt_done_stamp: float | None = None
        self._probe_rtt_round_done = False
        self._probe_rtt_cwnd_target = 0  # set on entering PROBE_RTT
        self._idle_restart = False
        self._resume_bw = 0.0  # the remembered bandwidth (``resume``), 0 if not resumed
        self._resume_until = 0  # round before which its share counts without samples
        self._pacing_rate = self._rate(
            INITIAL_WINDOW_SEGMENTS * mss / initial_rtt, HIGH_GAIN
        )

    # -- model accessors ---------------------------------------------------------------

    @property
    def btl_bw(self) -> float:
        """Bottleneck-bandwidth estimate, bytes/s (0 before the first sample)."""
        bw = self._bw.get() or 0.0
        if self.round_count < self._resume_until:
            bw = max(bw, self._resume_bw * RESUME_SHARE)
        return bw

    def resume(self, now: float, btl_bw: float, rtt: float) -> bool:
        """Start from a model this path had before (careful resume): ``RESUME_SHARE`` of
        ``btl_bw`` as the estimate for the first ``RESUME_ROUNDS`` rounds, and ``rtt`` (the
        round trip measured on this connection's greeting) as min_rtt, the window opened to
        STARTUP's gain over that at once instead of growing from the initial window one round
        trip at a time. Only before anything was delivered; returns whether it took effect."""
        if self.sampler.delivered or self.state is not BBRState.STARTUP or btl_bw <= 0 or rtt <= 0:
            return False
        self._resume_bw = btl_bw
        self._resume_until = self.round_count + RESUME_ROUNDS
        self.min_rtt = rtt
        self._min_rtt_stamp = now
        self._has_seen_rtt = True  # the startup rate below is not the initial window's guess
        self._cwnd = max(self._cwnd, self._bdp(self.btl_bw, HIGH_GAIN))
        self._pacing_rate = self._rate(self.btl_bw, HIGH_GAIN)
        return True

    def path_bandwidth(self) -> float | None:
        """BtlBw worth remembering for a later ``resume``: only once STARTUP has found the
        bottleneck, and from samples alone (never a resumed share)."""
        return (self._bw.get() or None) if self.full_bw_reached else None

    def stats(self) -> CongestionStats:
        # A PROBE_RTT before the pipe was found full is still the start-up (it returns there).
        starting = not self.full_bw_reached or self.state is BBRState.DRAIN
        return self._stats(state=self.state.value, starting=starting, btl_bw=self.btl_bw,
                           min_rtt=self.min_rtt)

    @property
    def min_cwnd(self) -> int:
        """``MIN_WINDOW_REQUESTS`` requests of the largest size sent in the last 10 rounds."""
        return MIN_WINDOW_REQUESTS * max(self.mss, self._request_size.get() or 0)

    # -- events ------------------------------------------------------------------------

    def on_packet_sent(self, now: float, packet_id: int, nbytes: int) -> None:
        if self.sampler.bytes_in_flight == 0 and self.sampler.is_app_limited:
            # Restarting from idle: no need to probe, pace at the estimate (bbr_cwnd_event).
            self._idle_restart = True
            if self.state is BBRState.PROBE_BW:
                self._set_pacing_rate(self.btl_bw, 1.0)
            elif self.state is BBRState.PROBE_RTT:
                self._check_probe_rtt_done(now)
        self._request_size.update(nbytes, self.round_count)
        self.sampler.on_sent(now, packet_id, nbytes)

    def on_packet_acked(self, now: float, packet_id: int) -> None:
        rs = self.sampler.on_acked(now, packet_id)
        self._sustained_loss = self._loss_is_sustained(now)
        self._update_bw(rs)
        self._update_cycle_phase(rs)
        self._check_full_bw_reached(rs)
        self._check_drain()
        self._update_min_rtt(now, rs)
        self._update_gains()
        self._set_pacing_rate(self.btl_bw, self.pacing_gain)
        self._set_cwnd(rs.packet.nbytes)

    def on_packet_lost(self, now: float, packet_id: int) -> None:
        packet = self.sampler.on_lost(packet_id)
        self._cwnd = max(self._cwnd - packet.nbytes, self.min_cwnd)

    # -- model updates (one per tcp_bbr.c function) --------------------------------------

    def _update_bw(self, rs: RateSample) -> None:
        self._round_start = False
        if not rs.valid:
            return
        if rs.prior_delivered >= self._next_round_delivered:
            self._next_round_delivered = self.sampler.delivered
            self.round_count += 1
            self._round_start = True
        # No more than reached the receiver over the sample's round trip: TCP hands replies
        # over in order, and those held behind a hole (at 1 % loss, or after the bottleneck
        # queue overflowed) come out together, a burst of "delivery" above the link that the
        # max filter would keep while the other connections' acks keep the clock running.
        bw = rs.delivery_rate
        if rs.arrival_interval > 0:
            bw = min(bw, rs.arrival_rate)
        # App-limited samples show the application's rate, not the path's: keep them out
        # unless they are at least as high as the current estimate.
        if not rs.is_app_limited or bw >= self.btl_bw:
            self._bw.update(bw, self.round_count)

    def _update_cycle_phase(self, rs: RateSample) -> None:
        if self.state is BBRState.PROBE_BW and self._is_next_cycle_phase(rs):
            self._advance_cycle_phase()

    def _is_next_cycle_phase(self, rs: RateSample) -> bool:
        full_length = self.sampler.delivered_time - self._cycle_stamp > self.min_rtt
        gain = self.pacing_gain
        if gain == 1.0:
            return full_length
        if gain > 1.0:
            # Probe until inflight reaches gain*BDP; give up early on loss (shallow buffer).
            return full_length and (
                rs.losses > 0 or rs.prior_in_flight >= self._inflight(self.btl_bw, gain)
            )
        # Drain phase: stop as soon as the queue we added is estimated gone.
        return full_length or rs.prior_in_flight <= self._inflight(self.btl_bw, 1.0)

    def _advance_cycle_phase(self) -> None:
        self._cycle_index = (self._cycle_index + 1) % len(PACING_GAIN_CYCLE)
        self._cycle_stamp = self.sampler.delivered_time

    def on_path_loss(self, now: float, nbytes: int) -> None:
        if nbytes > 0:
            self._round_resent += nbytes
            second = math.floor(now)
            if not self._loss_seconds or self._loss_seconds[-1] != second:
                self._loss_seconds.append(second)

    def _loss_is_sustained(self, now: float) -> bool:
        """Whether loss was reported in ``SUSTAINED_LOSS_SECONDS`` distinct seconds of the
        last ``SUSTAINED_LOSS_SPAN``."""
        seconds = self._loss_seconds
        while seconds and seconds[0] < now - SUSTAINED_LOSS_SPAN:
            seconds.popleft()
        return len(seconds) >= SUSTAINED_LOSS_SECONDS

    def _check_full_bw_reached(self, rs: RateSample) -> None:
        if self.full_bw_reached or not self._round_start:
            return
        delivered = self.sampler.delivered - self._round_delivered_mark
        resent, self._round_resent = self._round_resent, 0
        self._round_delivered_mark = self.sampler.delivered
        if delivered > 0 and resent > STARTUP_LOSS_RATE * delivered:
            self.full_bw_reached = True  # the bottleneck queue overflows: the pipe is full
            return
        if self._resume_bw and (self._bw.get() or 0.0) >= RESUME_REACHED * self._resume_bw:
            self.full_bw_reached = True  # samples reached what this path carried before
            return
        if rs.is_app_limited:
            return
        if self.btl_bw >= self._full_bw * FULL_BW_GROWTH:
            self._full_bw = self.btl_bw
            self._full_bw_count = 0
            return
        self._full_bw_count += 1
        self.full_bw_reached = self._full_bw_count >= FULL_BW_ROUNDS

    def _check_drain(self) -> None:
        if self.state is BBRState.STARTUP and self.full_bw_reached:
            self.state = BBRState.DRAIN
        if (
            self.state is BBRState.DRAIN
            and self.sampler.bytes_in_flight <= self._inflight(self.btl_bw, 1.0)
        ):
            self._enter_probe_bw()

    def _update_min_rtt(self, now: float, rs: RateSample) -> None:
        expired = now > self._min_rtt_stamp + MIN_RTT_WINDOW
        recent = self._recent_rtt.update(rs.rtt, now)
        if expired and recent <= self.min_rtt * SIMILAR_MIN_RTT:
            expired = False  # a recent sample came close: the model still holds, no probe
            self._min_rtt_stamp = now
        if expired and not self._idle_restart and self.state is not BBRState.PROBE_RTT:
            self._prior_cwnd = self._cwnd  # restored when PROBE_RTT ends
            self.state = BBRState.PROBE_RTT
            self._probe_rtt_done_stamp = None
            # Half the BDP of the min_rtt that expired, not of the sample that replaces it,
            # which may carry a queue or a TCP stall (5 s seen at 900 ms / 1 %): half of that
            # BDP would drain nothing.
            self._probe_rtt_cwnd_target = self._bdp(self.btl_bw, PROBE_RTT_CWND_GAIN)
        if rs.rtt <= self.min_rtt or expired:
            self.min_rtt = rs.rtt
            self._min_rtt_stamp = now
        if self.state is BBRState.PROBE_RTT:
            # Samples taken at the PROBE_RTT cwnd say nothing about the path's rate.
            self.sampler.mark_app_limited()
            if (self._probe_rtt_done_stamp is None
                    and self.sampler.bytes_in_flight <= self._probe_rtt_cwnd()):
                self._probe_rtt_done_stamp = now + PROBE_RTT_DURATION
                self._probe_rtt_round_done = False
                self._next_round_delivered = self.sampler.delivered
            elif self._probe_rtt_done_stamp is not None:
                if self._round_start:
                    self._probe_rtt_round_done = True
                if self._probe_rtt_round_done:
                    self._check_probe_rtt_done(now)
        if rs.delivered > 0:
            self._idle_restart = False

    def _update_gains(self) -> None:
        if self.state is BBRState.STARTUP:
            self.pacing_gain, self.cwnd_gain = HIGH_GAIN, HIGH_GAIN
        elif self.state is BBRState.DRAIN:
            self.pacing_gain, self.cwnd_gain = DRAIN_GAIN, HIGH_GAIN
        elif self.state is BBRState.PROBE_BW:
            self.pacing_gain, self.cwnd_gain = PACING_GAIN_CYCLE[self._cycle_index], CWND_GAIN
        else:
            self.pacing_gain, self.cwnd_gain = 1.0, 1.0

    # -- state transitions ------------------------------------------------------------

    def _enter_probe_bw(self) -> None:
        self.state = BBRState.PROBE_BW
        # Start at a random phase, never the 0.75 one, so competing flows desynchronise.
        self._cycle_index = (
            len(PACING_GAIN_CYCLE) - 1 - self._rng.randrange(CYCLE_RANDOM_PHASES)
        )
        self._advance_cycle_phase()

    def _check_probe_rtt_done(self, now: float) -> None:
        if self._probe_rtt_done_stamp is None or now <= self._probe_rtt_done_stamp:
            return
        self._min_rtt_stamp = now  # min_rtt is fresh: wait another window before probing
        self._cwnd = max(self._cwnd, self._prior_cwnd)
        if self.full_bw_reached:
            self._enter_probe_bw()
        else:
            self.state = BBRState.STARTUP
        self._probe_rtt_done_stamp = None

    # -- outputs ------------------------------------------------------------------------

    def _rate(self, bw: float, gain: float) -> float:
        return bw * gain * (1 - PACING_MARGIN)

    def _set_pacing_rate(self, bw: float, gain: float) -> None:
        if not self._has_seen_rtt and math.isfinite(self.sampler.srtt):
            # First RTT sample: replace the guessed initial RTT in the startup rate.
            self._has_seen_rtt = True
            self._pacing_rate = self._rate(self._cwnd / self.sampler.srtt, HIGH_GAIN)
        rate = self._rate(bw, gain)
        if self.full_bw_reached or rate > self._pacing_rate:
            self._pacing_rate = rate

    def _bdp(self, bw: float, gain: float) -> int:
        if math.isinf(self.min_rtt):
            return INITIAL_WINDOW_SEGMENTS * self.mss
        return math.ceil(bw * self.min_rtt * gain)

    def _inflight(self, bw: float, gain: float) -> int:
        """Target bytes in flight for `gain`, including the quantization budget."""
        inflight = self._bdp(bw, gain) + QUANTIZATION_SEGMENTS * self.mss
        if self.state is BBRState.PROBE_BW and self._cycle_index == 0:
            inflight += PROBE_EXTRA_SEGMENTS * self.mss
        return inflight

    def _set_cwnd(self, acked: int) -> None:
        # Room for one whole request of the largest recent size: a request may start only
        # while inflight < cwnd, and one larger than the spare window must still pipeline.
        largest = max(self.mss, self._request_size.get() or 0)
        gain, held = self.cwnd_gain, 0
        if self.state is BBRState.PROBE_BW:  # the path's loss may change within a phase
            if self._sustained_loss:
                held = int(self.btl_bw * min(self.min_rtt, HELD_ALLOWANCE_MAX))
            else:
                gain = CLEAN_CWND_GAIN
        target = self._inflight(self.btl_bw, gain) + largest - self.mss + held
        cwnd = self._cwnd
        if self.full_bw_reached:
            cwnd = min(cwnd + acked, target)  # grow toward, or snap down to, the target
        elif cwnd < target or self.sampler.delivered < INITIAL_WINDOW_SEGMENTS * self.mss:
            cwnd += acked  # slow-start toward the target while the estimate grows
        cwnd = max(cwnd, self.min_cwnd)
        if self.state is BBRState.PROBE_RTT:
            cwnd = min(cwnd, self._probe_rtt_cwnd())  # drain the queue to see the true min RTT
        self._cwnd = cwnd

    def _probe_rtt_cwnd(self) -> int:
        return max(self._probe_rtt_cwnd_target, self.min_cwnd)
