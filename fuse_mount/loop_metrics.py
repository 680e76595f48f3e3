"""Counters and histograms that the event loop bumps on every FUSE read, without a lock.

prometheus_client's counters and histograms take a lock on every ``inc`` and ``observe``
(about 1 and 2 us each here). A warm 16 KiB read made five such calls: a seventh of
``BlockFetcher.read``'s time (docs/throughput.md, session 52). These metrics are plain numbers
instead, changed by the event loop's thread alone and read when scraped; under the GIL a
scrape from another thread sees each number whole (a histogram's count and sum may be one
observation apart). They are exposed as prometheus_client's would be.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from typing import Any, Callable, Generic, Iterable, Sequence, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Child = TypeVar("Child")


class LoopCounter:
    """One counter's value: only the event loop's thread may ``inc`` it."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopHistogram:
    """One histogram's bucket counts and sum: only the event loop's thread may ``observe``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last for values above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a bucket's bound is <=
        self.sum += value


class LoopFamily(Generic[Child]):
    """A metric's children by label values, made on first use as prometheus_client's are."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 new_child: Callable[[], Child]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._new_child = new_child
        self._children: dict[tuple[str, ...], Child] = {}

    def labels(self, *values: str) -> Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child

    def family(self) -> Metric:
        """The metric as the registry exposes it now."""
        raise NotImplementedError

    def children(self) -> list[tuple[list[str], Child]]:
        """Each child with its label values, as they are now (a scrape runs in another
        thread, which the loop may add children under)."""
        return [(list(values), child) for values, child in list(self._children.items())]


class LoopCounterFamily(LoopFamily[LoopCounter]):
    """A counter (``name`` ends in ``_total``) with zero or more labels."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, LoopCounter)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children():
            family.add_metric(values, child.value)
        return family


class LoopHistogramFamily(LoopFamily[LoopHistogram]):
    """A histogram with ``buckets`` (upper bounds, ascending; +Inf is added) and labels."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        super().__init__(name, documentation, labelnames,
                         functools.partial(LoopHistogram, self.buckets))
        self._bounds = [*map(floatToGoString, self.buckets), "+Inf"]

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children():
            cumulative = list(zip(self._bounds, itertools.accumulate(list(child.counts))))
            family.add_metric(values, cumulative, child.sum)
        return family


class LoopMetrics(Collector):
    """Exports ``families`` when the registry is scraped."""

    def __init__(self, families: Iterable[LoopFamily[Any]]) -> None:
        self.families = list(families)

    def describe(self) -> list[Metric]:
        return self.collect()

    def collect(self) -> list[Metric]:
        return [f.family() for f in self.families]
