"""Kathleen Nichols' windowed min/max filter (fabric.congestion.windowed_filter)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.congestion import WindowedFilter

WINDOW = 10.0

# (time step, value) pairs: steps of zero let several samples share one time, as BBR's do
# within a round.
samples = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 7.0, 12.0]),
        st.floats(min_value=0, max_value=1e9, allow_nan=False),
    ),
    min_size=1,
    max_size=80,
)


def _run(filt, steps):
    """Feed (step, value) pairs; yield (time, value, estimate, history) after each."""
    t, history = 0.0, []
    for step, value in steps:
        t += step
        history.append((t, value))
        yield t, value, filt.update(value, t), history


@given(samples)
def test_max_estimate_is_a_sample_from_the_window_and_not_below_recent_ones(steps):
    for t, value, est, history in _run(WindowedFilter.max_filter(WINDOW), steps):
        in_window = [v for ts, v in history if t - ts <= WINDOW]
        recent = [v for ts, v in history if t - ts <= WINDOW / 4]
        assert est in in_window
        assert est >= value
        assert est >= max(recent)


@given(samples)
def test_min_estimate_is_a_sample_from_the_window_and_not_above_recent_ones(steps):
    for t, value, est, history in _run(WindowedFilter.min_filter(WINDOW), steps):
        in_window = [v for ts, v in history if t - ts <= WINDOW]
        recent = [v for ts, v in history if t - ts <= WINDOW / 4]
        assert est in in_window
        assert est <= value
        assert est <= min(recent)


def test_max_forgets_a_peak_once_it_leaves_the_window():
    f = WindowedFilter.max_filter(10)
    f.update(100.0, 0)
    for t in range(1, 11):
        assert f.update(50.0, t) == 100.0
    assert f.update(50.0, 11) == 50.0


def test_max_falls_back_to_the_second_best_when_the_best_expires():
    f = WindowedFilter.max_filter(10)
    f.update(100.0, 0)
    f.update(80.0, 3)  # after a quarter window: becomes the second choice
    f.update(10.0, 6)
    assert f.get() == 100.0
    assert f.update(10.0, 11) == 80.0


def test_get_is_none_before_any_sample_and_reset_restarts():
    f = WindowedFilter.max_filter(10)
    assert f.get() is None
    f.update(5.0, 0)
    assert f.reset(1.0, 1) == 1.0
    assert f.get() == 1.0


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        WindowedFilter.max_filter(0)
