"""The controller registry, the shared interface and the delivery-rate sampler."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.congestion import (
    BBR,
    CONTROLLERS,
    CongestionController,
    CongestionStats,
    Cubic,
    DeliveryRateSampler,
    create_controller,
)
from fabric.congestion.base import TIME_RESOLUTION

MSS = 64 * 1024


@pytest.mark.parametrize(("name", "cls"), [("bbr", BBR), ("cubic", Cubic)])
def test_registry_builds_each_controller_with_the_interface(name, cls):
    cc = create_controller(name, initial_rtt=0.05, mss=MSS)
    assert isinstance(cc, cls)
    assert isinstance(cc, CongestionController)
    assert cc.name == name
    assert cc.cwnd == 10 * MSS  # initial window, as the kernel's TCP_INIT_CWND
    assert cc.bytes_in_flight == 0
    assert cc.pacing_rate > 0
    stats = cc.stats()
    assert isinstance(stats, CongestionStats)
    assert stats.name == name
    assert stats.min_rtt == math.inf


def test_registry_names_and_unknown_name():
    assert set(CONTROLLERS) == {"bbr", "cubic"}
    with pytest.raises(ValueError, match="bbr, cubic"):
        create_controller("reno")


def test_registry_passes_extra_keywords():
    a = create_controller("bbr", seed=7)
    b = create_controller("bbr", seed=7)
    assert a._rng.random() == b._rng.random()


def test_mss_scales_the_windows():
    cc = create_controller("cubic", mss=4096)
    assert cc.cwnd == 10 * 4096
    assert cc.min_cwnd == 4 * 4096


def test_can_send_while_in_flight_is_below_cwnd():
    cc = create_controller("bbr", mss=MSS)
    assert cc.can_send(64 * MSS)  # one oversized request may always start on an empty pipe
    for i in range(9):
        cc.on_packet_sent(0.0, i, MSS)
    assert cc.can_send(4 * MSS)  # 9 segments in flight < 10: may overshoot by one request
    cc.on_packet_sent(0.0, 9, MSS)
    assert not cc.can_send(1)


def test_sampler_measures_the_rate_of_a_paced_flow():
    """Requests sent every 10 ms, each acked 100 ms later: 64 KiB / 10 ms once the pipe is full."""
    s = DeliveryRateSampler()
    rates = []
    for i in range(40):
        s.on_sent(i * 0.01, i, MSS)
        if i >= 10:
            rs = s.on_acked(0.1 + (i - 10) * 0.01, i - 10)
            assert rs.rtt == pytest.approx(0.1)
            rates.append(rs.delivery_rate)
    assert s.delivered == 30 * MSS
    assert s.bytes_in_flight == 10 * MSS
    assert rates[-1] == pytest.approx(MSS / 0.01, rel=0.02)
    assert all(r <= MSS / 0.01 * 1.01 for r in rates)


def test_sampler_sample_acked_at_its_send_instant_has_no_rate():
    s = DeliveryRateSampler()
    s.on_sent(1.0, 0, MSS)
    rs = s.on_acked(1.0, 0)
    assert not rs.valid
    assert rs.delivery_rate == 0.0
    assert s.srtt == s.min_rtt == TIME_RESOLUTION  # one clock unit, never 0


@pytest.mark.parametrize("name", sorted(CONTROLLERS))
@pytest.mark.parametrize("ack_delay", [0.0, -0.5])
def test_controllers_take_acks_at_or_before_their_send_instant(name, ack_delay):
    """A clock that did not move, or stepped back, between a send and its ack: no exception,
    and a pacing rate that is still a positive number."""
    cc = create_controller(name, initial_rtt=0.05, mss=MSS)
    for i in range(20):
        cc.on_packet_sent(1.0, i, MSS)
    for i in range(20):
        cc.on_packet_acked(1.0 + ack_delay, i)
    assert 0 < cc.pacing_rate < math.inf
    assert cc.stats().srtt > 0


# Operations on a sampler: ("send", size), ("ack", pick), ("lose", pick), ("wait", dt).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(1, 8 * MSS)),
        st.tuples(st.sampled_from(["ack", "lose"]), st.integers(0, 1000)),
        st.tuples(st.just("wait"), st.floats(0.0, 0.5)),
    ),
    max_size=120,
)


@given(operations)
def test_sampler_accounting_and_interval_invariants(ops):
    s = DeliveryRateSampler()
    now, next_id, in_flight = 0.0, 0, {}
    sent = acked = lost = 0
    for op, arg in ops:
        if op == "wait":
            now += arg
        elif op == "send":
            s.on_sent(now, next_id, arg)
            in_flight[next_id] = arg
            next_id += 1
            sent += arg
        elif in_flight:
            pid = sorted(in_flight)[arg % len(in_flight)]
            size = in_flight.pop(pid)
            if op == "lose":
                s.on_lost(pid)
                lost += size
            else:
                rs = s.on_acked(now, pid)
                acked += size
                # An interval never undercuts the request's own RTT, nor hence min RTT (but
                # a request acked at its send instant has an interval of 0 and no rate).
                assert rs.rtt >= s.min_rtt >= TIME_RESOLUTION
                assert rs.interval >= rs.rtt or (rs.interval == 0 and not rs.valid)
                assert size <= rs.delivered <= s.delivered
                assert rs.prior_in_flight >= size
        assert s.bytes_in_flight == sent - acked - lost == sum(in_flight.values())
        assert s.delivered == acked and s.lost == lost


def test_sampler_app_limited_mark_clears_once_the_bubble_is_delivered():
    s = DeliveryRateSampler()
    s.on_sent(0.0, 0, MSS)
    s.mark_app_limited()
    s.on_sent(0.0, 1, MSS)
    assert s.is_app_limited
    assert not s.on_acked(0.1, 0).is_app_limited  # sent before the mark
    assert s.is_app_limited
    assert s.on_acked(0.1, 1).is_app_limited
    assert not s.is_app_limited  # everything in flight at the mark is delivered


def test_sampler_counts_bytes_delivered_beside_its_packets_in_their_rate():
    """Demand replies share the path: a packet's sample covers them, its window does not."""
    s = DeliveryRateSampler()
    s.on_sent(0.0, 0, MSS)
    s.on_delivered(0.05, 3 * MSS)
    assert s.bytes_in_flight == MSS
    rs = s.on_acked(0.1, 0)
    assert rs.delivered == 4 * MSS
    assert rs.delivery_rate == pytest.approx(4 * MSS / 0.1)
    assert s.delivered == 4 * MSS


@pytest.mark.parametrize("name", ["bbr", "cubic"])
def test_controllers_take_bytes_delivered_beside_their_packets(name):
    cc = create_controller(name, mss=MSS)
    cc.on_packet_sent(0.0, 0, MSS)
    cc.on_bytes_delivered(0.05, 3 * MSS)
    cc.on_packet_acked(0.1, 0)
    assert cc.stats().delivered_bytes == 4 * MSS
    assert cc.bytes_in_flight == 0


def test_sampler_app_limited_mark_waits_for_its_packets_not_for_other_bytes():
    s = DeliveryRateSampler()
    s.on_sent(0.0, 0, MSS)
    s.mark_app_limited()
    s.on_delivered(0.05, 2 * MSS)  # demand bytes: not the packet in flight at the mark
    s.on_sent(0.06, 1, MSS)
    assert s.on_acked(0.1, 0) and s.is_app_limited
    assert s.on_acked(0.16, 1).is_app_limited
    assert not s.is_app_limited


def test_sampler_counts_losses_and_reports_them_with_the_next_ack():
    s = DeliveryRateSampler()
    for i in range(3):
        s.on_sent(0.0, i, MSS)
    s.on_lost(0)
    assert s.lost == MSS and s.lost_packets == 1
    assert s.on_acked(0.1, 1).losses == MSS
    assert s.on_acked(0.1, 2).losses == 0
    assert s.bytes_in_flight == 0


def test_sampler_rejects_unknown_and_duplicate_ids():
    s = DeliveryRateSampler()
    s.on_sent(0.0, 1, MSS)
    with pytest.raises(ValueError):
        s.on_sent(0.0, 1, MSS)
    with pytest.raises(KeyError):
        s.on_acked(0.1, 2)
    with pytest.raises(ValueError):
        s.on_sent(0.0, 3, 0)


def test_stats_loss_rate():
    stats = create_controller("cubic").stats()
    assert stats.loss_rate == 0.0
    lossy = CongestionStats(
        name="x", state="s", starting=False, btl_bw=0, min_rtt=1, srtt=1, pacing_rate=1, cwnd=1,
        bytes_in_flight=0, delivered_bytes=99, lost_bytes=1, lost_packets=1,
    )
    assert lossy.loss_rate == pytest.approx(0.01)
