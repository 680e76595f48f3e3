"""The cap on the hub's pacing of bulk replies (fabric.transport.reply_pacing), without sockets:
the highest pacing rate of the last gain cycle, with a margin, in steps; checked against a
plain list of every sample as the reference."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fabric.transport.reply_pacing import (CYCLE_ROUND_TRIPS, MARGIN, MIN_WINDOW, SHARE,
                                           SHARE_MIN_RTT, STEP, ReplyPacing)
from fabric.transport.tcp import UNLIMITED_PACING, limit_pacing

RATE = 24e6  # bytes/s: a 200 Mbit/s link's payload
BBR_GAINS = (1.25, 0.75, 1, 1, 1, 1, 1, 1)


def bbr_cycles(pacing: ReplyPacing, rtt: float, cycles: int, start: float = 0.0
               ) -> tuple[set[int], float]:
    """Feed ``cycles`` of BBR's gain cycle at RATE, a request every eighth of a round trip;
    the caps asked for and the time after."""
    caps, now = set(), start
    for _ in range(cycles):
        for gain in BBR_GAINS:
            for _ in range(8):
                caps.add(pacing.limit(now, gain * RATE, rtt))
                now += rtt / 8
    return caps, now


def test_the_cap_holds_through_the_gain_cycle_and_lets_the_probing_phase_through() -> None:
    for rtt in (0.060, 0.900):
        pacing = ReplyPacing()
        caps, _ = bbr_cycles(pacing, rtt, cycles=3)
        steady = {c for c in caps if c >= 1.25 * RATE * MARGIN}
        assert len(steady) == 1  # once the probing phase has been seen, the cap stays
        assert 1.25 * RATE * MARGIN <= steady.pop() < 1.25 * RATE * MARGIN * STEP


def test_the_cap_follows_start_up_up_and_comes_down_a_window_later() -> None:
    pacing = ReplyPacing()
    rtt = 0.060
    caps = [pacing.limit(i * rtt, RATE * 2 ** i / 64, rtt) for i in range(7)]  # doubling
    assert caps == sorted(caps) and caps[-1] >= RATE * MARGIN
    top = caps[-1]
    assert pacing.limit(6 * rtt + MIN_WINDOW / 2, RATE / 2, rtt) == top
    assert pacing.limit(6 * rtt + MIN_WINDOW * 1.01, RATE / 2, rtt) < top / 1.8


def test_a_long_path_keeps_the_highest_rate_for_its_whole_cycle() -> None:
    pacing = ReplyPacing()
    rtt = 0.9
    high = pacing.limit(0.0, 1.25 * RATE, rtt)
    assert pacing.limit(CYCLE_ROUND_TRIPS * rtt * 0.99, RATE, rtt) == high
    assert pacing.limit(CYCLE_ROUND_TRIPS * rtt * 1.01, RATE, rtt) < high


def test_before_any_rtt_sample_the_window_is_the_shortest() -> None:
    pacing = ReplyPacing()
    high = pacing.limit(0.0, RATE, math.inf)
    assert pacing.limit(MIN_WINDOW * 1.01, RATE / 4, math.inf) < high


def test_no_rate_yet_asks_for_no_cap() -> None:
    """A cap of nothing would hold back the very replies the controller's first rate needs."""
    for rate in (0.0, math.inf):
        assert ReplyPacing().limit(0.0, rate, math.inf) == UNLIMITED_PACING


@given(st.lists(st.tuples(st.floats(0, 0.5), st.floats(1e3, 1e10), st.floats(1e-4, 1.0)),
                min_size=1, max_size=60))
def test_the_cap_is_the_window_max_with_its_margin_rounded_up_a_step(
        samples: list[tuple[float, float, float]]) -> None:
    """Against the reference: the max of every sample still in the window (one that has left
    it, under the window of its time, stays out), times MARGIN, rounded up to a power of STEP
    (so at most one step above it)."""
    pacing = ReplyPacing()
    alive: list[tuple[float, float]] = []
    now = 0.0
    for gap, rate, rtt in samples:
        now += gap
        cap = pacing.limit(now, rate, rtt)
        window = max(MIN_WINDOW, CYCLE_ROUND_TRIPS * rtt)
        alive = [(t, r) for t, r in alive + [(now, rate)] if t >= now - window]
        highest = max(r for _, r in alive) * MARGIN
        assert highest * (1 - 1e-9) <= cap <= math.ceil(highest * STEP * (1 + 1e-9))
        assert cap == math.ceil(STEP ** round(math.log(cap, STEP)))


def test_each_of_several_connections_gets_its_share_of_the_cap() -> None:
    """N bulk connections each get ``SHARE / N`` of the spoke's cap, never more than all of it."""
    rtt = 0.9
    whole = ReplyPacing().limit(0.0, RATE, rtt)
    for connections, share in ((0, 1.0), (1, 1.0), (2, min(1.0, SHARE / 2)), (4, SHARE / 4),
                               (8, SHARE / 8)):
        cap = ReplyPacing().limit(0.0, RATE, rtt, connections)
        assert share * RATE * MARGIN <= cap < share * RATE * MARGIN * STEP
        assert cap <= whole


def test_on_a_shorter_path_each_connection_gets_the_whole_cap() -> None:
    for rtt in (SHARE_MIN_RTT / 100, SHARE_MIN_RTT / 2):
        assert ReplyPacing().limit(0.0, RATE, rtt, 4) == ReplyPacing().limit(0.0, RATE, rtt, 1)


def test_a_cap_for_a_stream_that_is_not_a_socket_is_left_unset() -> None:
    """A hub serving a stream with no ``setsockopt`` (not a TCP socket) ignores the cap."""
    assert limit_pacing(object(), 1_000_000) is None
