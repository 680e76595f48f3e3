"""The token-bucket pacer (fabric.congestion.pacer)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.congestion import Pacer
from fabric.congestion.pacer import SLACK_BYTES

MSS = 64 * 1024

rates = st.floats(min_value=1e5, max_value=1e10)
bursts = st.integers(min_value=1, max_value=16 * MSS)
sizes = st.lists(st.integers(min_value=1, max_value=4 * 1024 * 1024), min_size=1, max_size=40)
gaps = st.lists(st.floats(min_value=0, max_value=0.05), min_size=40, max_size=40)


def _send_all(pacer, sizes, gaps):
    """A sender that becomes ready after each gap and then waits for the pacer."""
    now, times = 0.0, []
    for size, gap in zip(sizes, gaps):
        now += gap
        ready = pacer.next_send_time(now, size)
        assert ready >= now
        now = ready
        # Asked again at the time it named, the pacer says go.
        assert pacer.next_send_time(now, size) == now
        pacer.on_sent(now, size)
        times.append(now)
    return times


@given(rates, bursts, sizes, gaps)
def test_bytes_sent_in_any_interval_are_bounded_by_burst_plus_rate(rate, burst, sizes, gaps):
    times = _send_all(Pacer(rate, burst=burst, burst_seconds=0.0), sizes, gaps)
    allowance = max(burst, max(sizes)) + SLACK_BYTES
    _assert_bounded(times, sizes, allowance, rate)


@given(rates, bursts, sizes, gaps)
def test_with_a_bucket_of_burst_seconds_the_bound_adds_its_capacity(rate, burst, sizes, gaps):
    pacer = Pacer(rate, burst=burst)
    times = _send_all(pacer, sizes, gaps)
    _assert_bounded(times, sizes, pacer.capacity + max(sizes) + SLACK_BYTES, rate)


@given(rates, bursts, sizes, gaps, gaps)
def test_a_late_sender_adds_at_most_its_late_credit_to_the_bound(
        rate, burst, sizes, gaps, lateness):
    """A sender that comes back up to 50 ms after the time it was told sends no more than the
    bucket, the late credit and the largest request beyond the rate."""
    pacer = Pacer(rate, burst=burst)
    now, times = 0.0, []
    for size, gap, late in zip(sizes, gaps, lateness):
        now = pacer.next_send_time(now + gap, size) + late
        assert pacer.next_send_time(now, size) == now
        pacer.on_sent(now, size)
        times.append(now)
    allowance = pacer.capacity + rate * pacer.late_credit + max(sizes) + SLACK_BYTES
    _assert_bounded(times, sizes, allowance, rate)


def _assert_bounded(times, sizes, allowance, rate):
    for i in range(len(times)):
        for j in range(i, len(times)):
            sent = sum(sizes[i:j + 1])
            assert sent <= allowance + rate * (times[j] - times[i]) * (1 + 1e-9)


@given(rates, bursts, st.integers(min_value=1, max_value=4 * 1024 * 1024))
def test_a_greedy_sender_runs_at_the_rate(rate, burst, size):
    n = 50
    pacer = Pacer(rate, burst=burst, burst_seconds=0.0)
    times = _send_all(pacer, [size] * n, [0.0] * n)
    # After the initial bucket, each request waits for its own bytes' worth of tokens.
    elapsed = times[-1] - times[0]
    expected = max(0, n * size - max(burst, size)) / rate
    assert elapsed == pytest.approx(expected, rel=1e-6, abs=2 * SLACK_BYTES / rate)


def test_full_bucket_allows_an_initial_burst_then_paces():
    pacer = Pacer(1e6, burst=2 * MSS)
    assert pacer.next_send_time(0.0, MSS) == 0.0
    pacer.on_sent(0.0, MSS)
    assert pacer.next_send_time(0.0, MSS) == 0.0
    pacer.on_sent(0.0, MSS)
    assert pacer.next_send_time(0.0, MSS) == pytest.approx(MSS / 1e6)


def test_a_request_larger_than_the_bucket_goes_and_delays_the_next():
    pacer = Pacer(1e6, burst=MSS)
    big = 16 * MSS
    assert pacer.next_send_time(0.0, big) == 0.0  # a full bucket is enough to start it
    pacer.on_sent(0.0, big)
    # The bucket is now 15 MSS in debt: the next request waits for that and its own tokens.
    assert pacer.next_send_time(0.0, MSS) == pytest.approx(16 * MSS / 1e6)


def test_idle_time_refills_only_up_to_the_burst():
    pacer = Pacer(1e6, burst=2 * MSS)
    pacer.on_sent(0.0, 2 * MSS)
    pacer.on_sent(100.0, 2 * MSS)  # a long idle: the bucket was full, not 100 s worth
    assert pacer.next_send_time(100.0, MSS) == pytest.approx(100.0 + MSS / 1e6)


def test_update_rate_with_now_keeps_tokens_earned_at_the_old_rate():
    pacer = Pacer(1e6, burst=MSS)
    pacer.on_sent(0.0, MSS)
    pacer.update_rate(1e3, now=MSS / 2e6)  # half a bucket earned at 1 MB/s
    assert pacer.rate == 1e3
    wait = pacer.next_send_time(MSS / 2e6, MSS) - MSS / 2e6
    assert wait == pytest.approx((MSS / 2) / 1e3)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_rate_must_be_positive_and_finite(rate):
    with pytest.raises(ValueError):
        Pacer(rate)
    with pytest.raises(ValueError):
        Pacer(1e6).update_rate(rate)


def test_the_bucket_holds_burst_seconds_at_high_rates_so_late_wakeups_keep_the_rate():
    """A sender that always wakes 1 ms late still averages the rate at 1 GB/s with 2 MiB
    requests; with a bucket of only `burst` bytes each lateness would be lost."""
    rate, size, late = 1e9, 2 * 1024 * 1024, 0.001
    pacer = Pacer(rate, burst=2 * MSS)
    assert pacer.capacity == pytest.approx(rate * 0.002)
    now = 0.0
    for _ in range(200):
        now = pacer.next_send_time(now, size) + late
        pacer.on_sent(now, size)
    assert 200 * size / now >= 0.95 * rate
    assert Pacer(1e6, burst=2 * MSS).capacity == 2 * MSS  # slow paths: the byte floor


def test_a_sender_that_always_comes_back_late_keeps_the_rate():
    """At 200 Mbit/s a request (200 KB) is larger than the bucket (128 KiB): without the late
    credit a sender that always comes back 1 ms after the time it was told loses each
    millisecond; with it, it keeps the rate."""
    rate, size = 25e6, 200 * 1024

    def run(pacer: Pacer) -> float:
        now = 0.0
        for _ in range(200):
            now = pacer.next_send_time(now, size) + 0.001
            assert pacer.next_send_time(now, size) == now
            pacer.on_sent(now, size)
        return 200 * size / now

    assert run(Pacer(rate, burst=2 * MSS)) >= 0.97 * rate
    assert run(Pacer(rate, burst=2 * MSS, late_credit=0.0)) < 0.95 * rate


def test_idle_time_earns_no_late_credit():
    """Lateness is credited only to a send that was told to wait: after an idle second the
    bucket holds its cap, not more."""
    pacer = Pacer(25e6, burst=2 * MSS)
    pacer.on_sent(0.0, 2 * MSS)
    assert pacer.next_send_time(1.0, 4 * MSS) == 1.0
    pacer.on_sent(1.0, 4 * MSS)  # the full bucket (2 MSS) went, 2 MSS in debt
    assert pacer.next_send_time(1.0, MSS) == pytest.approx(1.0 + 3 * MSS / 25e6)


def test_late_credit_is_bounded():
    """A send a second late keeps 10 ms of tokens beyond the cap, not a second's."""
    rate = 25e6
    pacer = Pacer(rate, burst=2 * MSS, burst_seconds=0.0, late_credit=0.010)
    pacer.on_sent(0.0, 2 * MSS)
    due = pacer.next_send_time(0.0, 4 * MSS)
    assert due == pytest.approx(2 * MSS / rate)
    late = due + 1.0
    assert pacer.next_send_time(late, 4 * MSS) == late
    pacer.on_sent(late, 4 * MSS)  # it had the cap (2 MSS) and 10 ms at the rate
    left = 2 * MSS + 0.010 * rate - 4 * MSS
    assert pacer.next_send_time(late, 2 * MSS) == pytest.approx(late + (2 * MSS - left) / rate)
