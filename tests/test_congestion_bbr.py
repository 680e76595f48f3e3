"""BBR (fabric.congestion.bbr): unit behaviour, and on the simulated link of bench/linksim.py.

Link numbers: 200 Mbit/s = 25e6 bytes/s, 60 ms base RTT (BDP 1.5 MB, ~23 requests of 64 KiB);
the long path is 100 Mbit/s at 900 ms (BDP 11 MB). "Loss" is per request (see linksim).
"""

import pytest

from fabric.congestion import BBR, BBRState, Cubic
from fabric.congestion.bbr import (CLEAN_CWND_GAIN, CWND_GAIN, HELD_ALLOWANCE_MAX, HIGH_GAIN,
                                   MIN_RTT_WINDOW, PACING_GAIN_CYCLE, PACING_MARGIN,
                                   PROBE_RTT_CWND_GAIN, SUSTAINED_LOSS_SECONDS,
                                   SUSTAINED_LOSS_SPAN)
from bench.linksim import AppLimit, FlowSpec, LinkConfig, simulate

MSS = 64 * 1024
KIB = 1024
RATE = 25e6
RTT = 0.06
LINK = LinkConfig(rate=RATE, rtt=RTT)


def _window_utilizations(result, start_rtts, end_rtts, width=5):
    return [
        (k, result.utilization(k * RTT, (k + width) * RTT))
        for k in range(start_rtts, end_rtts - width + 1)
    ]


def test_initial_pacing_rate_is_high_gain_over_initial_window():
    cc = BBR(initial_rtt=0.1, mss=MSS)
    assert cc.state is BBRState.STARTUP
    assert cc.pacing_rate == pytest.approx(HIGH_GAIN * 10 * MSS / 0.1 * (1 - PACING_MARGIN))


def test_converges_to_the_bottleneck_within_30_round_trips():
    r = simulate(LINK, [FlowSpec(BBR(seed=1))], 60 * RTT, seed=1)
    windows = _window_utilizations(r, 0, 60)
    # The first 5-RTT window from which goodput never again drops below 90 % of line rate.
    settled = next(k for k, _ in windows if all(u >= 0.9 for j, u in windows if j >= k))
    assert settled + 5 <= 30
    stats = r.flows[0].snapshot_at(30 * RTT)
    assert stats.state == "probe_bw"
    assert stats.btl_bw == pytest.approx(RATE, rel=0.02)
    assert stats.min_rtt == pytest.approx(RTT + MSS / RATE, abs=1e-6)


def test_pacing_rate_is_gain_times_btl_bw_in_probe_bw():
    r = simulate(LINK, [FlowSpec(BBR(seed=1))], 3.0, seed=1, snapshot_interval=0.01)
    gains = {
        round(s.pacing_rate / s.btl_bw / (1 - PACING_MARGIN), 6)
        for t, s in r.flows[0].snapshots
        if t > 1.5
    }
    assert gains == set(PACING_GAIN_CYCLE)


def test_queue_stays_bounded_even_with_a_deep_buffer():
    """A 10-BDP buffer: BBR's own model, not the buffer, must keep the queue small."""
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=int(10 * LINK.bdp))
    r = simulate(link, [FlowSpec(BBR(seed=1))], 10.0, seed=1)
    probe_bw = r.flows[0].first_time_in("probe_bw")
    assert r.tail_drops == 0
    assert r.queue_peak(0, 10.0) <= 2.25 * link.bdp  # the STARTUP overshoot, then DRAIN
    assert r.queue_peak(probe_bw + 1.0, 10.0) <= 0.5 * link.bdp
    assert r.queue_mean(probe_bw + 1.0, 10.0) <= 0.15 * link.bdp
    assert r.utilization(probe_bw + 1.0, 10.0) >= 0.97


@pytest.mark.parametrize(
    ("rate", "rtt", "duration", "measure_from", "cubic_at_most"),
    [
        # 60 ms: CUBIC, counting 64 KiB segments, loses about half (not a collapse): see docs.
        pytest.param(25e6, 0.06, 8.0, 20 * 0.06, 0.75, id="200Mbit-60ms"),
        pytest.param(12.5e6, 0.9, 60.0, 25.0, 0.3, id="100Mbit-900ms"),
    ],
)
def test_holds_rate_under_one_percent_loss_where_cubic_does_not(
    rate, rtt, duration, measure_from, cubic_at_most
):
    link = LinkConfig(rate=rate, rtt=rtt, loss=0.01)
    bbr = simulate(link, [FlowSpec(BBR(seed=0))], duration, seed=0)
    cubic = simulate(link, [FlowSpec(Cubic())], duration, seed=0)
    bbr_util = bbr.utilization(measure_from, duration)
    cubic_util = cubic.utilization(measure_from, duration)
    assert bbr_util >= 0.9
    assert cubic_util <= cubic_at_most
    assert bbr_util >= 1.3 * cubic_util
    # The model is untouched by loss: BtlBw is the line rate at the end.
    assert bbr.flows[0].snapshots[-1][1].btl_bw == pytest.approx(rate, rel=0.02)


def _steady_pipe(cc, n, *, lose=(), rtt=RTT, path_loss=False):
    """Feed n requests sent every MSS/RATE and acked `rtt` later; ids in `lose` are lost
    instead; with `path_loss`, the transport reports a resent segment every second."""
    dt = MSS / RATE
    events = [(i * dt, 0, i) for i in range(n)] + [(i * dt + rtt, 1, i) for i in range(n)]
    reported = -1
    for t, kind, i in sorted(events):
        if path_loss and int(t) > reported:
            reported = int(t)
            cc.on_path_loss(t, 1)
        if kind == 0:
            cc.on_packet_sent(t, i, MSS)
        elif i in lose:
            cc.on_packet_lost(t, i)
        else:
            cc.on_packet_acked(t, i)


def test_loss_does_not_lower_the_model_or_the_rate():
    clean, lossy = BBR(seed=3, mss=MSS), BBR(seed=3, mss=MSS)
    _steady_pipe(clean, 600)
    _steady_pipe(lossy, 600, lose=set(range(300, 600, 25)))  # 4 % of requests
    assert lossy.state is clean.state is BBRState.PROBE_BW
    assert lossy.btl_bw == pytest.approx(clean.btl_bw, rel=0.01)
    assert lossy.min_rtt == clean.min_rtt
    # Loss may end a 1.25 probing phase early (as in the kernel), but the rate per unit of
    # gain is the same model rate.
    assert lossy.pacing_rate / lossy.pacing_gain == pytest.approx(
        clean.pacing_rate / clean.pacing_gain, rel=0.01
    )


def _report_loss(cc, seconds, *, until=0.0):
    """One loss report in each of the ``seconds`` whole seconds before ``until``."""
    for k in range(seconds, 0, -1):
        cc.on_path_loss(until - k, 1)


@pytest.mark.parametrize("rtt, requests", [(RTT, 2500), (0.9, 6000)])
def test_the_window_has_room_for_held_replies_while_the_transport_reports_loss(rtt, requests):
    """Replies held behind TCP's holes count in flight: while loss goes on the window is the
    kernel's CWND_GAIN BDPs and one BDP more, at most HELD_ALLOWANCE_MAX of BtlBw (on the
    900 ms path, a ninth of one); a clean path, or one whose reports are older than
    SUSTAINED_LOSS_SPAN, gets CLEAN_CWND_GAIN BDPs."""
    clean, lossy, healed = (BBR(seed=3, mss=MSS) for _ in range(3))
    _report_loss(healed, SUSTAINED_LOSS_SECONDS, until=-SUSTAINED_LOSS_SPAN)
    for cc in (clean, lossy, healed):
        _steady_pipe(cc, requests, rtt=rtt, path_loss=cc is lossy)
        assert cc.state is BBRState.PROBE_BW
    assert lossy.btl_bw == pytest.approx(clean.btl_bw)
    assert lossy.min_rtt == pytest.approx(clean.min_rtt)
    room = lossy.cwnd - clean.cwnd
    expected = clean.btl_bw * ((CWND_GAIN - CLEAN_CWND_GAIN) * clean.min_rtt
                               + min(rtt, HELD_ALLOWANCE_MAX))
    assert room == pytest.approx(expected, rel=0.02)
    assert healed.cwnd == clean.cwnd


def test_a_loss_takes_only_the_lost_bytes_out_of_cwnd():
    cc = BBR(seed=3, mss=MSS)
    _steady_pipe(cc, 300)
    for i in range(300, 310):
        cc.on_packet_sent(300 * MSS / RATE, i, MSS)
    before_cwnd, before_rate = cc.cwnd, cc.pacing_rate
    cc.on_packet_lost(300 * MSS / RATE + RTT, 300)
    assert cc.cwnd == max(before_cwnd - MSS, cc.min_cwnd)
    assert cc.pacing_rate == before_rate


def test_two_flows_share_the_link_fairly():
    flows = [FlowSpec(BBR(seed=10)), FlowSpec(BBR(seed=11), start=2.0)]
    r = simulate(LINK, flows, 30.0, seed=2)
    assert r.jain_index(15.0, 30.0) >= 0.9
    assert r.utilization(15.0, 30.0) >= 0.95


def test_probe_rtt_starts_ten_seconds_after_the_last_min_rtt_sample():
    """Stop-and-wait: one RTT sample of 50 ms, then 60 ms forever: min_rtt is never renewed."""
    cc = BBR(seed=0, mss=MSS)
    t, pid, states = 0.0, 0, []
    while t < 11.0:
        cc.on_packet_sent(t, pid, MSS)
        t += 0.05 if pid == 0 else 0.06
        cc.on_packet_acked(t, pid)
        states.append((t, cc.state, cc.cwnd, cc.min_rtt))
        pid += 1
    entered = next(t for t, s, _, _ in states if s is BBRState.PROBE_RTT)
    left = next(t for t, s, _, _ in states if t > entered and s is not BBRState.PROBE_RTT)
    assert 10.05 < entered <= 10.05 + 0.06  # first ack after min_rtt (taken at 0.05 s) expired
    assert 0.2 <= left - entered <= 0.2 + 2 * 0.06  # 200 ms plus finishing a round trip
    assert all(cwnd <= 4 * MSS for t, s, cwnd, _ in states if s is BBRState.PROBE_RTT)
    assert cc.min_rtt == pytest.approx(0.06)
    assert cc.state is BBRState.PROBE_BW


def _stop_and_wait(cc, rtts, until):
    """Send one MSS request at a time, acked after the next of ``rtts``; the states seen."""
    t, pid, states = 0.0, 0, []
    while t < until:
        cc.on_packet_sent(t, pid, MSS)
        t += rtts(pid)
        cc.on_packet_acked(t, pid)
        states.append((t, cc.state))
        pid += 1
    return states


def test_probe_rtt_is_skipped_while_recent_samples_stay_within_an_eighth_of_min_rtt():
    """60 ms once, then 66 ms (10 % above) for 30 s: three windows expire, none is probed."""
    cc = BBR(seed=0, mss=MSS)
    states = _stop_and_wait(cc, lambda pid: 0.06 if pid == 0 else 0.066, 30.0)
    assert all(s is not BBRState.PROBE_RTT for _, s in states)
    assert cc.min_rtt == pytest.approx(0.06)


def test_probe_rtt_is_not_skipped_on_samples_older_than_the_recent_window():
    """60 ms samples for the first 1.8 s, then 25 % above: the expiry at 11.8 s probes."""
    cc = BBR(seed=0, mss=MSS)
    states = _stop_and_wait(cc, lambda pid: 0.06 if pid < 30 else 0.075, 13.0)
    last_min_sample = 30 * 0.06
    entered = next(t for t, s in states if s is BBRState.PROBE_RTT)
    assert last_min_sample + 10.0 < entered < last_min_sample + 10.0 + 2 * 0.075


def _burst_estimate(loss_seconds: int, start: float = 1.0) -> float:
    """BtlBw after ten requests sent at ``start`` are acked together 0.2 s later (a delivery
    rate of 10 MSS / 0.2 s), of which the receiver's kernel had got only half (a release of
    replies TCP held behind a hole); loss reported in ``loss_seconds`` seconds before 0."""
    cc = BBR(seed=0, mss=MSS)
    _report_loss(cc, loss_seconds)
    cc.on_path_arrivals(start, 0)  # the count the sends are measured from
    for pid in range(10):
        cc.on_packet_sent(start, pid, MSS)
    cc.on_path_arrivals(start + 0.2, 5 * MSS)  # the spoke looks just before it acks
    for pid in range(10):
        cc.on_packet_acked(start + 0.2, pid)
    return cc.btl_bw


@pytest.mark.parametrize("loss_seconds", [0, SUSTAINED_LOSS_SECONDS])
def test_bandwidth_samples_are_capped_by_what_reached_the_receiver(loss_seconds):
    """With loss reported or without: a queue that overflowed once leaves holes too, and the
    replies released from behind them are a burst as far above the link as random loss's."""
    assert _burst_estimate(loss_seconds) == pytest.approx(5 * MSS / 0.2)


def test_without_arrival_counts_bandwidth_samples_are_not_capped():
    """The simulated link and other transports give no counts: their samples stand."""
    cc = BBR(seed=0, mss=MSS)
    for pid in range(10):
        cc.on_packet_sent(1.0, pid, MSS)
    for pid in range(10):
        cc.on_packet_acked(1.2, pid)
    assert cc.btl_bw == pytest.approx(10 * MSS / 0.2)


def test_minimum_window_is_four_of_the_largest_recent_requests():
    cc = BBR(seed=0, mss=MSS)
    assert cc.min_cwnd == 4 * MSS
    cc.on_packet_sent(0.0, 1, 2 * 1024 * KIB)
    assert cc.min_cwnd == 4 * 2 * 1024 * KIB
    cc.on_packet_acked(0.001, 1)
    assert cc.cwnd >= 4 * 2 * 1024 * KIB


def test_probe_rtt_follows_a_route_change_on_the_simulated_link():
    new_rtt = 0.08
    link = LinkConfig(rate=RATE, rtt=RTT, rtt_change=(3.0, new_rtt))
    r = simulate(link, [FlowSpec(BBR(seed=1))], 16.0, seed=1, snapshot_interval=0.01)
    flow = r.flows[0]
    entered = flow.first_time_in("probe_rtt")
    # min_rtt was last matched no later than the route change (plus one old RTT).
    assert 10.0 <= entered <= 3.0 + RTT + 10.0
    left = flow.first_time_in("probe_bw", after=entered)
    assert 0.2 <= left - entered <= 0.2 + 3 * new_rtt
    # Half a BDP in flight (BBR v2), not v1's 4 packets: the probe keeps the link half busy.
    # The BDP is the expired min_rtt's, not that of the longer sample that replaced it.
    half_bdp = PROBE_RTT_CWND_GAIN * RATE * (RTT + MSS / RATE)
    assert all(s.cwnd <= half_bdp * 1.05 for t, s in flow.snapshots if s.state == "probe_rtt")
    assert r.utilization(entered, left) >= 0.45  # v1's 4 packets: 0.34
    after = flow.snapshot_at(left + 0.5)
    assert after.min_rtt == pytest.approx(new_rtt + MSS / RATE, abs=1e-6)
    assert r.utilization(left + 1.0, 16.0) >= 0.95


class _IgnoresAppLimited(BBR):
    """Control for the app-limited test: a BBR that is never told it was app-limited."""

    def on_app_limited(self, now):
        pass


@pytest.mark.parametrize(("cls", "keeps_estimate"), [(BBR, True), (_IgnoresAppLimited, False)])
def test_app_limited_samples_do_not_lower_btl_bw(cls, keeps_estimate):
    app = AppLimit(start=3.0, end=6.0, rate=0.2 * RATE)  # 10 s of quiet at a fifth of the link
    r = simulate(LINK, [FlowSpec(cls(seed=1), app_limit=app)], 7.0, seed=1)
    flow = r.flows[0]
    assert flow.goodput(3.5, 6.0) == pytest.approx(0.2 * RATE, rel=0.05)
    during = flow.snapshot_at(5.9).btl_bw
    if keeps_estimate:
        assert during == pytest.approx(RATE, rel=0.02)
        assert flow.goodput(6.2, 7.0) >= 0.95 * RATE  # back at full rate within ~3 RTTs
    else:
        assert during <= 0.3 * RATE


@pytest.mark.parametrize(
    ("sizes", "min_util", "max_mean_queue_bdps"),
    [
        pytest.param((64 * KIB, 256 * KIB, 1024 * KIB), 0.95, 0.15, id="64K-1M"),
        # Each 4 MiB response is 2.8 BDPs: the queue holds about one of them at times.
        pytest.param((64 * KIB, 4096 * KIB), 0.95, 1.5, id="64K-4M"),
    ],
)
def test_mixed_request_sizes(sizes, min_util, max_mean_queue_bdps):
    link = LinkConfig(rate=RATE, rtt=RTT, queue_limit=int(10 * LINK.bdp))
    r = simulate(link, [FlowSpec(BBR(seed=1), request_sizes=sizes)], 10.0, seed=1)
    assert r.utilization(4.0, 10.0) >= min_util
    assert r.queue_mean(4.0, 10.0) <= max_mean_queue_bdps * link.bdp
    assert r.flows[0].snapshot_at(10.0).btl_bw == pytest.approx(RATE, rel=0.02)


def _app_limited_startup(resent_share: float, until: float = 3.0) -> BBR:
    """A flow that keeps 8 requests in flight and marks itself app-limited at every send,
    with the transport below reporting ``resent_share`` of each ack's bytes as resent."""
    cc = BBR(seed=0, mss=MSS)
    t, sent, acked = 0.0, 0, 0
    while t < until:
        while sent - acked < 8:
            cc.on_app_limited(t)
            cc.on_packet_sent(t, sent, MSS)
            sent += 1
        t += RTT / 8
        cc.on_packet_acked(t, acked)
        cc.on_path_loss(t, int(resent_share * MSS))
        acked += 1
    return cc


def test_startup_ends_on_loss_repaired_below_even_when_app_limited():
    """App-limited rounds never end STARTUP by the growth test; a round with more than 2 % of
    its bytes resent by TCP does, and 1 % does not."""
    assert _app_limited_startup(0.0).state is BBRState.STARTUP
    assert _app_limited_startup(0.01).state is BBRState.STARTUP
    lossy = _app_limited_startup(0.05)
    assert lossy.full_bw_reached and lossy.state is not BBRState.STARTUP


def test_stats_say_starting_until_the_pipe_is_found_full_and_drained():
    """``CongestionStats.starting`` (what the client's ``SteadyLoss`` waits out) covers STARTUP,
    DRAIN and a PROBE_RTT taken before the pipe was found full, which returns to STARTUP."""
    assert BBR(seed=0, mss=MSS).stats().starting
    # App-limited and clean: STARTUP never ends by growth, and 10 s after its one min_rtt
    # sample it probes for a lower one.
    probing = _app_limited_startup(0.0, until=MIN_RTT_WINDOW + 0.1)
    assert probing.state is BBRState.PROBE_RTT and not probing.full_bw_reached
    assert probing.stats().starting
    cc = BBR(seed=0, mss=MSS)
    _steady_pipe(cc, 300)
    assert cc.state is BBRState.PROBE_BW and not cc.stats().starting


LONG_RATE, LONG_RTT = 12.5e6, 0.9
LONG_LINK = LinkConfig(rate=LONG_RATE, rtt=LONG_RTT, loss=0.01)


def test_a_resumed_flow_fills_a_long_path_in_a_few_round_trips():
    """Careful resume on the simulated 900 ms / 1 % path: from half the remembered rate the
    link is full from the second round trip on, where STARTUP from the initial window has used
    at most 60 % of it up to the sixth."""
    cold = simulate(LONG_LINK, [FlowSpec(BBR(seed=1))], 20.0, seed=1)
    resumed_cc = BBR(seed=1)
    assert resumed_cc.resume(0.0, LONG_RATE, LONG_RTT)
    resumed = simulate(LONG_LINK, [FlowSpec(resumed_cc)], 20.0, seed=1)
    assert resumed.utilization(2 * LONG_RTT, 6 * LONG_RTT) >= 0.95
    assert cold.utilization(2 * LONG_RTT, 6 * LONG_RTT) <= 0.6
    assert resumed.utilization(0.0, 20.0) >= cold.utilization(0.0, 20.0) + 0.1
    # STARTUP ends once its samples reach the remembered rate, not three rounds later:
    # PROBE_BW within four round trips, and the queue never the STARTUP overshoot's.
    assert resumed.flows[0].first_time_in("probe_bw") <= 4 * LONG_RTT
    assert resumed.queue_peak(0.0, 20.0) <= 0.5 * cold.queue_peak(0.0, 20.0)


def test_a_stale_record_gives_way_to_the_path_s_own_samples():
    """Resumed from four times the link's rate (a path slower than remembered): within a few
    rounds the estimate is the link's, and the overshoot about STARTUP's own."""
    cc = BBR(seed=1)
    assert cc.resume(0.0, 4 * RATE, RTT)
    assert cc.btl_bw == pytest.approx(2 * RATE)  # RESUME_SHARE of it, until samples say more
    r = simulate(LINK, [FlowSpec(cc)], 5.0, seed=1, snapshot_interval=RTT)
    assert r.flows[0].snapshot_at(12 * RTT).btl_bw == pytest.approx(RATE, rel=0.02)
    assert r.flows[0].first_time_in("probe_bw") <= 20 * RTT
    cold = simulate(LINK, [FlowSpec(BBR(seed=1))], 5.0, seed=1)
    assert r.queue_peak(0.0, 5.0) <= 1.1 * cold.queue_peak(0.0, 5.0)
    assert r.utilization(1.0, 5.0) >= 0.97


def test_only_a_flow_that_has_delivered_nothing_resumes_and_only_a_measured_rate_is_kept():
    cc = BBR(seed=0, mss=MSS)
    assert cc.path_bandwidth() is None  # STARTUP has not found the bottleneck
    _steady_pipe(cc, 400)
    assert not cc.resume(400 * MSS / RATE, 10 * RATE, RTT)
    assert cc.btl_bw == pytest.approx(RATE, rel=0.02)
    assert cc.state is BBRState.PROBE_BW
    assert cc.path_bandwidth() == pytest.approx(RATE, rel=0.02)
    # A resumed flow keeps what its samples measured, never the remembered share.
    resumed = BBR(seed=0, mss=MSS)
    assert resumed.resume(0.0, 10 * RATE, RTT)
    assert resumed.path_bandwidth() is None
    _steady_pipe(resumed, 400)
    assert resumed.path_bandwidth() == pytest.approx(RATE, rel=0.02)
