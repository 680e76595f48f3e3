"""CUBIC (fabric.congestion.cubic, RFC 8312): unit behaviour and on the simulated link."""

import itertools

import pytest

from fabric.congestion import BBR, Cubic
from fabric.congestion.cubic import BETA, C, RENO_FRIENDLY_ALPHA
from bench.linksim import FlowSpec, LinkConfig, simulate

MSS = 64 * 1024
RATE = 25e6
RTT = 0.06


class Rounds:
    """An unconstrained path: each round sends a full cwnd at `now` and acks it one RTT later."""

    def __init__(self, cc: Cubic, rtt: float) -> None:
        self.cc, self.rtt, self.now = cc, rtt, 0.0
        self._ids = itertools.count()

    @property
    def segments(self) -> float:
        return self.cc.cwnd / MSS

    def round(self, lose_first: bool = False) -> None:
        ids = [next(self._ids) for _ in range(max(1, self.cc.cwnd // MSS))]
        for i in ids:
            self.cc.on_packet_sent(self.now, i, MSS)
        self.now += self.rtt
        for n, i in enumerate(ids):
            if lose_first and n == 0:
                self.cc.on_packet_lost(self.now, i)
            else:
                self.cc.on_packet_acked(self.now, i)

    def run_until(self, t: float) -> None:
        while self.now < t:
            self.round()


def test_slow_start_doubles_cwnd_every_round():
    path = Rounds(Cubic(mss=MSS), 0.1)
    for k in range(1, 5):
        path.round()
        assert path.cc.cwnd == 10 * 2**k * MSS
        assert path.cc.state == "slow_start"


def test_one_multiplicative_decrease_per_recovery_period():
    cc = Cubic(mss=MSS)
    for i in range(40):
        cc.on_packet_sent(0.0, i, MSS)
    cwnd = cc.cwnd
    cc.on_packet_lost(0.1, 0)
    assert cc.cwnd == int(cwnd * BETA)
    assert cc.ssthresh == cc.cwnd
    assert cc.state == "recovery"
    cc.on_packet_lost(0.1, 1)  # sent before the decrease: the same congestion event
    assert cc.cwnd == int(cwnd * BETA)
    cc.on_packet_acked(0.15, 2)  # sent before the decrease: still recovering, no growth
    assert cc.state == "recovery" and cc.cwnd == int(cwnd * BETA)
    cc.on_packet_sent(0.2, 100, MSS)
    cc.on_packet_sent(0.2, 101, MSS)
    cc.on_packet_acked(0.3, 100)  # sent after the decrease: recovery is over
    assert cc.state == "congestion_avoidance"
    before = cc.cwnd
    cc.on_packet_lost(0.3, 101)  # a new congestion event
    assert cc.cwnd == int(before * BETA)


def test_loss_tcp_repaired_below_is_a_congestion_event_once_per_round_trip():
    """The hub's resend reports are loss the requests never show: CUBIC decreases on them, at
    most once per smoothed RTT, and a report of nothing resent changes nothing."""
    path = Rounds(Cubic(mss=MSS), RTT)
    for _ in range(4):
        path.round()
    cwnd = path.cc.cwnd
    path.cc.on_path_loss(path.now, 0)
    assert path.cc.cwnd == cwnd
    path.cc.on_path_loss(path.now, 1448)
    assert path.cc.cwnd == int(cwnd * BETA) and path.cc.state == "recovery"
    path.cc.on_path_loss(path.now + RTT / 2, 1448)  # within the round trip: the same event
    assert path.cc.cwnd == int(cwnd * BETA)
    path.cc.on_path_loss(path.now + 2 * RTT, 1448)  # a round trip later: a new one
    assert path.cc.cwnd == int(int(cwnd * BETA) * BETA)


def _cubic_plateau_time(w_max: float, cwnd: float) -> float:
    """RFC 8312's K: seconds from the decrease until the curve is back at w_max."""
    return ((w_max - cwnd) / C) ** (1 / 3)


def test_congestion_avoidance_follows_the_cubic_curve_back_to_w_max():
    path = Rounds(Cubic(mss=MSS), 0.1)
    while path.segments < 100:
        path.round()
    w_max = path.segments
    path.round(lose_first=True)
    assert path.segments == pytest.approx(BETA * w_max, abs=1)
    k = _cubic_plateau_time(w_max, BETA * w_max)
    start = path.now
    path.run_until(start + 0.5 * k)
    assert BETA * w_max < path.segments < 0.99 * w_max  # concave approach
    path.run_until(start + k)
    assert path.segments == pytest.approx(w_max, rel=0.05)  # plateau at the old maximum
    path.run_until(start + 2 * k)
    assert path.segments > 1.2 * w_max  # convex probing beyond it


def test_fast_convergence_lowers_the_plateau_when_losing_ground():
    path = Rounds(Cubic(mss=MSS), 0.1)
    while path.segments < 100:
        path.round()
    path.round(lose_first=True)
    path.run_until(path.now + 1.0)  # well short of the plateau: cwnd < the last maximum
    w2 = path.segments
    path.round(lose_first=True)
    lowered = w2 * (1 + BETA) / 2
    start = path.now
    path.run_until(start + _cubic_plateau_time(lowered, BETA * w2))
    assert path.segments == pytest.approx(lowered, rel=0.05)
    assert path.segments < 0.95 * w2


def test_reno_friendly_region_at_short_rtt():
    """At 1 ms the cubic curve barely moves in 40 rounds; the AIMD estimate sets the pace."""
    path = Rounds(Cubic(mss=MSS), 0.001)
    while path.segments < 20:
        path.round()
    path.round(lose_first=True)
    start_segments = path.segments
    for _ in range(40):
        path.round()
    expected = start_segments + 40 * RENO_FRIENDLY_ALPHA
    assert path.segments == pytest.approx(expected, rel=0.1)


def test_pacing_rate_follows_linux_ratios():
    cc = Cubic(initial_rtt=0.1, mss=MSS)
    assert cc.pacing_rate == pytest.approx(2.0 * cc.cwnd / 0.1)  # slow start, no RTT yet
    cc.on_packet_sent(0.0, 0, MSS)
    cc.on_packet_sent(0.0, 1, MSS)
    cc.on_packet_acked(0.05, 0)
    assert cc.pacing_rate == pytest.approx(2.0 * cc.cwnd / 0.05)
    cc.on_packet_lost(0.05, 1)
    assert cc.state == "recovery"
    assert cc.pacing_rate == pytest.approx(1.2 * cc.cwnd / 0.05)


def test_app_limited_acks_do_not_grow_cwnd():
    cc = Cubic(mss=MSS)
    cc.on_packet_sent(0.0, 0, MSS)
    cc.on_app_limited(0.0)
    cc.on_packet_sent(0.0, 1, MSS)
    cc.on_packet_acked(0.1, 0)
    assert cc.cwnd == 11 * MSS  # sent before the app went quiet: slow start counts it
    cc.on_packet_acked(0.1, 1)
    assert cc.cwnd == 11 * MSS


def test_fills_the_link_without_loss():
    link = LinkConfig(rate=RATE, rtt=RTT)
    r = simulate(link, [FlowSpec(Cubic())], 10.0)
    assert r.utilization(2.0, 10.0) >= 0.95


def test_fills_a_deep_buffer_that_bbr_leaves_empty():
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=int(4 * RATE * RTT))
    cubic = simulate(link, [FlowSpec(Cubic())], 10.0)
    bbr = simulate(link, [FlowSpec(BBR(seed=1))], 10.0)
    assert cubic.queue_mean(2.0, 10.0) >= 1.0 * link.bdp
    assert bbr.queue_mean(2.0, 10.0) <= 0.15 * link.bdp
    assert bbr.utilization(2.0, 10.0) >= 0.97
