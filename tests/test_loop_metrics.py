"""The event loop's lock-free metrics are exposed as prometheus_client's own would be."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from fuse_mount.loop_metrics import LoopCounterFamily, LoopHistogramFamily, LoopMetrics

BUCKETS = (0.0001, 0.001, 0.01, 0.1, 1.0, 10.0)
LABELS = st.sampled_from(["cache", "hub"])
VALUES = st.one_of(st.floats(min_value=0, max_value=100, allow_nan=False),
                   st.sampled_from(BUCKETS))  # a value on a bound belongs in its bucket


def _exposed(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without prometheus_client's ``_created`` ones."""
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if line and not line.startswith("#") and "_created" not in line)


@given(st.lists(st.tuples(LABELS, VALUES), max_size=30),
       st.lists(st.tuples(LABELS, st.integers(0, 300)), max_size=30))
def test_the_same_observations_are_exposed_alike(observed: list[tuple[str, float]],
                                                 counted: list[tuple[str, int]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_histogram = Histogram("x_seconds", "h", ["source"], buckets=BUCKETS, registry=theirs)
    their_counter = Counter("x_bytes_total", "c", ["source"], registry=theirs)
    their_plain = Counter("x_hits_total", "p", registry=theirs)
    our_histogram = LoopHistogramFamily("x_seconds", "h", ["source"], BUCKETS)
    our_counter = LoopCounterFamily("x_bytes_total", "c", ["source"])
    our_plain = LoopCounterFamily("x_hits_total", "p")
    ours.register(LoopMetrics([our_histogram, our_counter, our_plain]))
    our_plain.labels()  # prometheus_client shows an unlabelled counter from the start
    for source, value in observed:
        their_histogram.labels(source).observe(value)
        our_histogram.labels(source).observe(value)
    for source, amount in counted:
        their_counter.labels(source).inc(amount)
        our_counter.labels(source).inc(amount)
        their_plain.inc(amount)
        our_plain.labels().inc(amount)
    assert _exposed(ours) == _exposed(theirs)


def test_labels_must_match_the_family() -> None:
    with pytest.raises(ValueError):
        LoopCounterFamily("x_total", "c", ["source"]).labels()
    with pytest.raises(ValueError):
        LoopHistogramFamily("x_seconds", "h", [], BUCKETS).labels("cache")
