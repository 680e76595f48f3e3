"""The WAN emulator's pure parts: the per-direction shaper and the unit parsers."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.wan import LinkSpec, parse_rate, parse_rtt
from bench.wan_shaper import (QUEUE_SLACK_BYTES, QUEUE_WAIT_BOUNDS_MS, LinkDirection,
                              queue_wait_quantile)

MTU = 1500
RATE = 8e6  # 1 MB/s: a 1000-byte packet takes exactly 1 ms to serialize
DELAY = 0.030


def _drain(link: LinkDirection, until: float, step: float) -> list[tuple[float, bytes]]:
    """Poll ``due`` every ``step`` seconds up to ``until``; (time, packet) pairs."""
    out = []
    t = 0.0
    while t <= until:
        out.extend((t, p) for p in link.due(t))
        t += step
    return out


def test_single_packet_arrives_after_serialization_plus_delay() -> None:
    link = LinkDirection(rate_bps=RATE, delay=DELAY, queue_bytes=10 * MTU)
    assert link.enqueue(1.0, bytes(1000))
    assert link.next_wakeup() == pytest.approx(1.0 + 0.001 + DELAY)
    assert link.due(1.0 + DELAY) == []
    assert link.due(1.0 + 0.001 + DELAY) == [bytes(1000)]
    assert link.next_wakeup() is None


def test_back_to_back_packets_are_spaced_by_serialization_time() -> None:
    link = LinkDirection(rate_bps=RATE, delay=DELAY, queue_bytes=10 * MTU)
    for i in range(5):
        assert link.enqueue(0.0, bytes([i]) * 1000)
    arrivals = []
    while link.next_wakeup() is not None:
        t = link.next_wakeup()
        arrivals.append((t, link.due(t)[0][0]))
    assert [p for _, p in arrivals] == list(range(5))
    assert [t for t, _ in arrivals] == pytest.approx([DELAY + 0.001 * (i + 1) for i in range(5)])


def test_tail_drop_when_queue_full_and_room_again_after_draining() -> None:
    link = LinkDirection(rate_bps=RATE, delay=DELAY, queue_bytes=3000)
    assert [link.enqueue(0.0, bytes(1000)) for _ in range(4)] == [True, True, True, False]
    assert link.counters.queue_dropped_packets == 1
    assert link.counters.queue_dropped_bytes == 1000
    # One packet's serialization time later, one packet's worth of room is back.
    assert link.backlog_bytes(0.001) == pytest.approx(2000)
    assert link.enqueue(0.001, bytes(1000))
    assert not link.enqueue(0.001, bytes(1000))


def test_each_accepted_packet_is_counted_by_how_long_it_waited_to_be_serialized() -> None:
    """Ten 1000-byte packets offered at once wait 0, 1, ..., 9 ms behind each other; a
    dropped one waits for nothing and is not counted."""
    link = LinkDirection(rate_bps=RATE, delay=DELAY, queue_bytes=10 * MTU)
    for _ in range(10):
        assert link.enqueue(0.0, bytes(1000))
    assert not link.enqueue(0.0, bytes(10 * MTU))
    expected = [0] * (len(QUEUE_WAIT_BOUNDS_MS) + 1)
    for wait_ms in range(10):  # bounds 1, 2, 5, 10: waits 0-1, 2, 3-5, 6-9 ms
        expected[next(i for i, b in enumerate(QUEUE_WAIT_BOUNDS_MS) if wait_ms <= b)] += 1
    assert link.counters.queue_wait_ms == expected == [2, 1, 3, 4] + [0] * 13
    assert queue_wait_quantile(link.counters.queue_wait_ms, 0.5) == 5
    assert queue_wait_quantile(link.counters.queue_wait_ms, 0.99) == 10
    assert math.isnan(queue_wait_quantile([0] * len(expected), 0.5))
    assert queue_wait_quantile([0] * (len(expected) - 1) + [1], 0.5) == math.inf


def test_queue_bound_does_not_count_packets_already_on_the_wire() -> None:
    """Packets in the delay line (serialized, propagating) take no queue room."""
    link = LinkDirection(rate_bps=RATE, delay=10.0, queue_bytes=1000)
    for i in range(100):
        assert link.enqueue(i * 0.001, bytes(1000))
    assert link.in_flight_packets == 100


def test_loss_uses_the_given_rng_and_counts() -> None:
    def run(seed: int) -> list[bool]:
        link = LinkDirection(RATE, DELAY, 10**9, loss=0.3, rng=random.Random(seed))
        return [link.enqueue(i * 0.01, bytes(100)) for i in range(200)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    link = LinkDirection(RATE, DELAY, 10**9, loss=0.3, rng=random.Random(7))
    results = [link.enqueue(i * 0.01, bytes(100)) for i in range(200)]
    assert link.counters.lost_packets == results.count(False)
    assert link.counters.lost_bytes == 100 * results.count(False)


def test_loss_ratio_is_binomial() -> None:
    n, p = 50_000, 0.05
    link = LinkDirection(1e12, 0.0, 10**12, loss=p, rng=random.Random(1))
    for i in range(n):
        link.enqueue(float(i), b"x")
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(link.counters.lost_packets - n * p) < 5 * sigma


@pytest.mark.parametrize(
    "kwargs",
    [dict(rate_bps=0), dict(delay=-1.0), dict(queue_bytes=0), dict(loss=1.0), dict(loss=-0.1)],
)
def test_rejects_nonsense(kwargs: dict) -> None:
    args = dict(rate_bps=RATE, delay=DELAY, queue_bytes=MTU) | kwargs
    with pytest.raises(ValueError):
        LinkDirection(**args)


offers = st.lists(
    st.tuples(st.floats(0.0, 0.005), st.integers(40, MTU)),  # (gap since last offer, size)
    max_size=200,
)


@given(offers=offers, queue_packets=st.integers(1, 20), loss=st.sampled_from([0.0, 0.2]))
def test_shaper_invariants(
    offers: list[tuple[float, int]], queue_packets: int, loss: float
) -> None:
    """FIFO; never early; never faster than the rate; queue bound held; counts add up."""
    queue_bytes = queue_packets * MTU
    link = LinkDirection(RATE, DELAY, queue_bytes, loss=loss, rng=random.Random(0))
    now = 0.0
    accepted: list[tuple[float, bytes]] = []
    for i, (gap, size) in enumerate(offers):
        now += gap
        packet = i.to_bytes(4, "big") + bytes(size - 4)
        if link.enqueue(now, packet):
            accepted.append((now, packet))
        assert link.backlog_bytes(now) <= queue_bytes + QUEUE_SLACK_BYTES
    delivered = _drain(link, now + DELAY + 1.0, 0.0005)
    assert [p for _, p in delivered] == [p for _, p in accepted]
    sent_at = dict((p, t) for t, p in accepted)
    for t, p in delivered:
        assert t >= sent_at[p] + DELAY + len(p) * 8 / RATE - 1e-9
    # Over any run of deliveries, the bytes are no more than the rate allows
    # plus the one packet being finished when the run starts.
    # (Delivery times are rounded up to the 0.5 ms polling step, hence its allowance.)
    cumulative = list(itertools.accumulate((len(p) for _, p in delivered), initial=0))
    for i in range(len(delivered)):
        for j in range(i, len(delivered)):
            span = delivered[j][0] - delivered[i][0]
            size = cumulative[j + 1] - cumulative[i]
            assert size <= RATE / 8 * (span + 0.0005) + MTU
    c = link.counters
    assert c.forwarded_packets == len(accepted)
    assert c.forwarded_packets + c.lost_packets + c.queue_dropped_packets == len(offers)
    assert link.in_flight_packets == 0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60ms", 0.06), ("900ms", 0.9), ("1.5s", 1.5), ("250us", 250e-6), ("0.2S", 0.2),
     (" 3 ms ", 0.003)],
)
def test_parse_rtt(text: str, seconds: float) -> None:
    assert parse_rtt(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "bps"),
    [("200mbit", 200e6), ("100Mbit", 100e6), ("1gbit", 1e9), ("64kbit", 64e3), ("1500bit", 1500.0),
     ("2.5gbit", 2.5e9)],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["60", "60 minutes", "ms", "", "-5ms", "1e3"])
def test_parse_rtt_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rtt(text)


@pytest.mark.parametrize("text", ["200", "200mbps", "200MB", "fast"])
def test_parse_rate_rejects(text: str) -> None:
    # "mbps" is refused on purpose: tc reads "bps" as *bytes* per second.
    with pytest.raises(ValueError):
        parse_rate(text)


def test_link_spec_default_queue_is_one_bdp_with_a_floor() -> None:
    spec = LinkSpec(rtt=0.060, rate_bps=200e6)
    assert spec.bdp_bytes == 1_500_000
    assert spec.effective_queue_bytes == 1_500_000
    assert LinkSpec(rtt=0.001, rate_bps=1e6).effective_queue_bytes == 32 * 1500
    assert LinkSpec(rtt=0.060, rate_bps=200e6, queue_bytes=9000).effective_queue_bytes == 9000


@pytest.mark.parametrize(
    "kwargs",
    [dict(rtt=-1.0), dict(rate_bps=0.0), dict(loss=1.0), dict(mtu=100), dict(queue_bytes=1000)],
)
def test_link_spec_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LinkSpec(**(dict(rtt=0.06, rate_bps=1e8) | kwargs))


def test_a_burst_meets_the_queue_bound_segment_by_segment() -> None:
    link = LinkDirection(rate_bps=RATE, delay=DELAY, queue_bytes=3000)
    arrivals = link.admit(0.0, [1000] * 5)
    assert arrivals[:3] == pytest.approx([DELAY + 0.001 * (i + 1) for i in range(3)])
    assert arrivals[3:] == [None, None]  # the tail that did not fit, not the whole burst
    assert link.counters.queue_dropped_packets == 2
    link.schedule(arrivals[2], b"three segments", 3, 3000)
    assert link.in_flight_packets == 3
    assert link.due(arrivals[2]) == [b"three segments"]
    assert (link.counters.forwarded_packets, link.counters.forwarded_bytes) == (3, 3000)


def test_a_burst_loses_segments_as_often_as_single_packets() -> None:
    link = LinkDirection(rate_bps=1e12, delay=0.0, queue_bytes=10**9, loss=0.01,
                         rng=random.Random(5))
    arrivals = [a for t in range(2000) for a in link.admit(float(t), [1500] * 44)]
    assert arrivals.count(None) == link.counters.lost_packets
    assert link.counters.lost_packets / len(arrivals) == pytest.approx(0.01, rel=0.1)
