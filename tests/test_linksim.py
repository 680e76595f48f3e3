"""The discrete-event link model itself, driven by a fixed-window controller."""

import math

import pytest

from fabric.congestion.base import CongestionStats, SampledController
from bench.linksim import AppLimit, FlowSpec, LinkConfig, per_request_loss, simulate

MSS = 64 * 1024
RATE = 25e6  # 200 Mbit/s
RTT = 0.06


class FixedWindow(SampledController):
    """Keeps exactly `window` bytes in flight and never paces: the link alone sets the pace."""

    name = "fixed"

    def __init__(self, window: int) -> None:
        super().__init__(mss=MSS)
        self._cwnd = window
        self._pacing_rate = 1e15
        self.rtts: list[float] = []

    def on_packet_sent(self, now, packet_id, nbytes):
        self.sampler.on_sent(now, packet_id, nbytes)

    def on_packet_acked(self, now, packet_id):
        self.rtts.append(self.sampler.on_acked(now, packet_id).rtt)

    def on_packet_lost(self, now, packet_id):
        self.sampler.on_lost(packet_id)

    def stats(self) -> CongestionStats:
        return self._stats(state="fixed", starting=False, btl_bw=0.0, min_rtt=self.sampler.min_rtt)


def test_window_below_bdp_is_window_limited():
    link = LinkConfig(rate=RATE, rtt=RTT)
    window = 8 * MSS  # about a third of the 1.5 MB BDP
    r = simulate(link, [FlowSpec(FixedWindow(window))], 3.0)
    expected = window / (RTT + MSS / RATE)
    assert r.flows[0].goodput(1.0, 3.0) == pytest.approx(expected, rel=0.02)
    assert r.queue_peak(1.0, 3.0) <= MSS  # back-to-back sends queue at most one behind another


def test_window_above_bdp_fills_the_link_and_the_excess_waits_in_the_queue():
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=10**9)
    excess = 20 * MSS
    window = math.ceil(link.bdp / MSS) * MSS + excess
    cc = FixedWindow(window)
    r = simulate(link, [FlowSpec(cc)], 3.0)
    assert r.utilization(1.0, 3.0) == pytest.approx(1.0, abs=0.01)
    # Little's law: what does not fit in the pipe waits in the queue, adding delay.
    standing = r.queue_mean(1.0, 3.0)
    assert standing == pytest.approx(window - link.bdp - MSS, rel=0.1)
    assert cc.rtts[-1] == pytest.approx(RTT + (standing + MSS) / RATE, rel=0.05)


def test_empty_queue_rtt_is_propagation_plus_one_serialisation():
    cc = FixedWindow(MSS)
    simulate(LinkConfig(rate=RATE, rtt=RTT), [FlowSpec(cc)], 1.0)
    assert min(cc.rtts) == pytest.approx(RTT + MSS / RATE, abs=1e-6)


def test_tail_drop_keeps_the_queue_within_the_buffer():
    buffer = 5 * MSS
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=buffer)
    r = simulate(link, [FlowSpec(FixedWindow(200 * MSS))], 2.0)
    assert r.tail_drops > 0
    assert r.queue_peak(0.0, 2.0) <= buffer
    # Every loss the sender heard of was a tail drop (the last ones are heard after the run).
    assert 0 < len(r.flows[0].loss_times) <= r.tail_drops


def test_random_loss_rate_matches_the_configured_probability():
    link = LinkConfig(rate=RATE, rtt=RTT, loss=0.05, queue_limit=10**9)
    r = simulate(link, [FlowSpec(FixedWindow(30 * MSS))], 20.0, seed=3)
    flow = r.flows[0]
    lost, delivered = len(flow.loss_times), len(flow.deliveries)
    n = lost + delivered
    assert n > 5000
    assert lost / n == pytest.approx(0.05, abs=4 * math.sqrt(0.05 * 0.95 / n))


def test_same_seed_same_run_and_other_seed_other_losses():
    link = LinkConfig(rate=RATE, rtt=RTT, loss=0.02)

    def run(seed):
        r = simulate(link, [FlowSpec(FixedWindow(30 * MSS))], 5.0, seed=seed)
        return r.flows[0].loss_times, r.flows[0].deliveries

    assert run(1) == run(1)
    assert run(1)[0] != run(2)[0]


def test_two_flows_share_one_fifo():
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=10**9)
    window = 40 * MSS  # each alone would fill the link
    r = simulate(link, [FlowSpec(FixedWindow(window)), FlowSpec(FixedWindow(window))], 3.0)
    assert r.utilization(1.0, 3.0) == pytest.approx(1.0, abs=0.01)
    assert r.jain_index(1.0, 3.0) > 0.99


def test_app_limit_caps_the_offered_rate_inside_its_window():
    link = LinkConfig(rate=RATE, rtt=RTT)
    app = AppLimit(start=1.0, end=3.0, rate=0.25 * RATE)
    r = simulate(link, [FlowSpec(FixedWindow(40 * MSS), app_limit=app)], 4.0)
    flow = r.flows[0]
    assert flow.goodput(1.5, 3.0) == pytest.approx(0.25 * RATE, rel=0.05)
    assert flow.goodput(3.5, 4.0) == pytest.approx(RATE, rel=0.05)


def test_route_change_lengthens_the_rtt():
    cc = FixedWindow(MSS)
    link = LinkConfig(rate=RATE, rtt=RTT, rtt_change=(1.0, 0.1))
    simulate(link, [FlowSpec(cc)], 2.0)
    assert cc.rtts[0] == pytest.approx(RTT + MSS / RATE, abs=1e-6)
    assert cc.rtts[-1] == pytest.approx(0.1 + MSS / RATE, abs=1e-6)


def test_request_sizes_are_drawn_from_the_given_set():
    sizes = (MSS, 4 * MSS)
    r = simulate(
        LinkConfig(rate=RATE, rtt=RTT), [FlowSpec(FixedWindow(40 * MSS), request_sizes=sizes)], 1.0
    )
    seen = {n for _, n in r.flows[0].deliveries}
    assert seen == set(sizes)


def test_per_request_loss_conversion():
    assert per_request_loss(0.01, 1500) == pytest.approx(0.01)
    assert per_request_loss(0.0, MSS) == 0.0
    # 1 % of 1500-byte segments loses about a third of 64 KiB responses.
    assert per_request_loss(0.01, MSS) == pytest.approx(0.355, abs=0.001)


def test_queue_statistics_over_a_window():
    link = LinkConfig(rate=RATE, rtt=RTT)
    r = simulate(link, [FlowSpec(FixedWindow(MSS))], 0.5)
    r.queue_trace[:] = [(0.0, 0), (1.0, 100), (2.0, 0)]
    assert r.queue_peak(0.0, 3.0) == 100
    assert r.queue_mean(0.0, 4.0) == pytest.approx(25.0)
    assert r.queue_peak(2.5, 3.0) == 0
    assert r.queue_mean(1.5, 2.5) == pytest.approx(50.0)
